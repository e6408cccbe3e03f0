"""The one mapping from SMG's sampling parameters to the engine's, and the prompt checks: what
SMG sends unset means the engine's default; what the engine cannot honour is refused by name."""

import base64

import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import common_pb2

from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import TokenImages
from xserv_engine.media import MediaPolicy
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.server.vllm_worker.convert import prompt_from_pb, sampling_params_from_pb
from xserv_engine.structured.constraint import Constraint


def test_what_smg_sends_for_an_unset_request_is_the_engine_default():
    # seen on the wire from smg 1.13 for a chat that sets nothing
    wire = pb.SamplingParams(top_p=1, repetition_penalty=1, skip_special_tokens=True,
                             spaces_between_special_tokens=True, n=1)
    assert sampling_params_from_pb(wire) == SamplingParams()
    # proto zeros mean the defaults too, but for skip_special_tokens, a plain bool (as in vLLM)
    assert sampling_params_from_pb(pb.SamplingParams()) == SamplingParams(skip_special_tokens=False)


def test_set_values_map_field_by_field():
    wire = pb.SamplingParams(temperature=0, top_p=0.9, top_k=40, min_p=0.05, max_tokens=7, min_tokens=2,
                             stop=["END"], stop_token_ids=[5], seed=11, n=3, logprobs=2, ignore_eos=True,
                             include_stop_str_in_output=True, presence_penalty=0.5, frequency_penalty=-0.5,
                             repetition_penalty=1.2, logit_bias={9: -100.0}, skip_special_tokens=False)
    params = sampling_params_from_pb(wire)
    assert params == SamplingParams(
        temperature=0.0, top_p=pytest.approx(0.9), top_k=40, min_p=pytest.approx(0.05), max_tokens=7, min_tokens=2,
        stop=("END",), stop_token_ids=(5,), seed=11, n=3, logprobs=True, top_logprobs=2, ignore_eos=True,
        include_stop_str_in_output=True, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=pytest.approx(1.2), logit_bias={9: -100.0}, skip_special_tokens=False)
    assert sampling_params_from_pb(pb.SamplingParams(logprobs=0)).logprobs  # the sampled token's only


def test_structured_outputs_map_to_constraints():
    assert sampling_params_from_pb(pb.SamplingParams(json_schema='{"type":"object"}')).constraint == \
        Constraint("json_schema", '{"type":"object"}')
    assert sampling_params_from_pb(pb.SamplingParams(regex="a+")).constraint == Constraint("regex", "a+")
    assert sampling_params_from_pb(pb.SamplingParams(json_object=True)).constraint == Constraint("json_object")
    choice = pb.SamplingParams(choice=pb.ChoiceConstraint(choices=["yes", "no"]))
    assert sampling_params_from_pb(choice).constraint == Constraint("choice", ("yes", "no"))


@pytest.mark.parametrize("field, wire", [
    ("prompt_logprobs", pb.SamplingParams(prompt_logprobs=1)),
    ("truncate_prompt_tokens", pb.SamplingParams(truncate_prompt_tokens=10)),
    ("structural_tag", pb.SamplingParams(structural_tag="{}")),
    ("grammar", pb.SamplingParams(grammar="root ::= 'a'")),
])
def test_what_the_engine_cannot_honour_is_refused_by_name(field, wire):
    with pytest.raises(InvalidRequest) as error:
        sampling_params_from_pb(wire)
    assert error.value.field == field


DATA_URL = "data:image/png;base64," + base64.b64encode(b"first").decode()


def refs(*items) -> pb.MediaRefs:
    """MediaRefs of URLs (images) or (modality, url) pairs."""
    return pb.MediaRefs(items=[pb.MediaRef(modality=common_pb2.IMAGE, url=item) if isinstance(item, str)
                               else pb.MediaRef(modality=item[0], url=item[1]) for item in items])


@pytest.mark.parametrize("field, generate", [
    ("input", pb.GenerateRequest()),
    ("tokenized.input_ids", pb.GenerateRequest(tokenized=pb.TokenizedInput())),
    ("kv_transfer_params", pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1]),
                                              kv_transfer_params=pb.KvTransferParams(remote_host="h"))),
    ("mm_inputs.model_specific_tensors", pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1]),
                                                            mm_inputs=pb.MultimodalInputs())),
    ("mm_inputs", pb.GenerateRequest(text="<|image_pad|>", mm_inputs=pb.MultimodalInputs())),
    ("extra_mm_inputs", pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1]),
                                           extra_mm_inputs=[pb.MultimodalInputs()])),
    ("data_parallel_rank", pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1]), data_parallel_rank=1)),
    ("media_refs", pb.GenerateRequest(text="<|image_pad|>", media_refs=refs(DATA_URL))),
    ("media_refs.items[1].modality", pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 1]), media_refs=refs(
        DATA_URL, (common_pb2.VIDEO, DATA_URL)))),
    ("media_refs.items[0].url", pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1]), media_refs=refs(
        "https://images.example.com/cat.png"))),
    ("media_refs.items[0].url", pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1]), media_refs=refs(
        "data:image/png;base64,not base64!"))),
])
def test_prompts_the_engine_cannot_serve_are_refused_by_name(field, generate):
    with pytest.raises(InvalidRequest) as error:
        prompt_from_pb(generate, MediaPolicy().load)
    assert error.value.field == field


def test_token_ids_and_text_prompts_pass_through():
    load = MediaPolicy().load
    assert prompt_from_pb(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[3, 4])), load) == [3, 4]
    assert prompt_from_pb(pb.GenerateRequest(text="hello", data_parallel_rank=0), load) == "hello"


def test_media_refs_become_token_ids_with_the_images_bytes_in_order(tmp_path):
    (tmp_path / "b.png").write_bytes(b"second")
    request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[5, 9, 9, 6]),
                                 media_refs=refs(DATA_URL, (common_pb2.IMAGE, (tmp_path / "b.png").as_uri())))
    prompt = prompt_from_pb(request, MediaPolicy(allowed_local_path=str(tmp_path)).load)
    assert prompt == TokenImages([5, 9, 9, 6], (b"first", b"second"))

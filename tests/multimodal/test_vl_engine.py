"""Chats with images through the engine: greedy tokens equal transformers' generate for
Qwen3-VL (DeepStack; dense and MoE) and Qwen3.5 (fp32), whole or in prompt chunks, beside text requests; the
encoder runs once per image; the prefix cache hits the same image and never another."""

import pytest
import torch

from tests.engine.conftest import Collector, generate, make_engine
from tests.support.vl_checkpoint import IMAGE_PAD, png, write_vl_model
from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import ChatInput
from xserv_engine.sampling_params import SamplingParams

pytest.importorskip("transformers")

WIDE, TALL, OTHER = png(100, 70, seed=1), png(40, 130, seed=2), png(100, 70, seed=3)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def vl(request, tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp(request.param)
    return path, write_vl_model(path, demo_dir, request.param)


def chat(*images: bytes, question: str = "What is in these pictures?") -> ChatInput:
    parts = [{"type": "image", "image": data} for data in images] + [{"type": "text", "text": question}]
    return ChatInput(messages=[{"role": "user", "content": parts}])


def reference(path, model, prompt: ChatInput, ids: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of the expanded prompt ids, its images through its own
    image processor."""
    import io

    import transformers
    from PIL import Image

    processor = transformers.AutoImageProcessor.from_pretrained(path)
    images = [Image.open(io.BytesIO(p["image"])) for m in prompt.messages for p in m["content"] if p["type"] == "image"]
    pixels = processor(images=images, return_tensors="pt")
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, pixel_values=pixels["pixel_values"],
                             image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(input_ids == IMAGE_PAD).int(),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def expanded_ids(llm, prompt: ChatInput) -> list[int]:
    """The prompt's ids as the engine serves them: each image's placeholder expanded."""
    requests = llm.generate_requests
    ids, _ = requests.tokenize(prompt)
    return requests.image_prompts.expand(prompt, ids)[0]


@pytest.mark.parametrize("budget", [8192, 16], ids=["whole-prompts", "16-token-chunks"])
def test_greedy_tokens_with_one_and_two_images_equal_transformers(vl, budget):
    path, model = vl
    engine = make_engine(path, max_num_batched_tokens=budget)
    try:
        for prompt in (chat(WIDE), chat(WIDE, TALL)):
            ids = expanded_ids(engine.engine, prompt)
            assert ids.count(IMAGE_PAD) == (6 if len(prompt.messages[0]["content"]) == 2 else 10)
            want = reference(path, model, prompt, ids, 8)
            got = generate(engine, prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert got.token_ids() == want
    finally:
        engine.shutdown()


def test_a_repeated_image_is_encoded_once_and_its_tokens_are_cached(vl):
    path, _ = vl
    engine = make_engine(path, block_size=4)
    try:
        encoder = engine.engine.runner.images
        first = generate(engine, chat(WIDE, question="Describe it."), max_tokens=2, temperature=0.0).final()
        assert first.usage.cached_prompt_tokens == 0
        again = generate(engine, chat(WIDE, question="Describe it."), max_tokens=2, temperature=0.0).final()
        image_end = expanded_ids(engine.engine, chat(WIDE)).index(IMAGE_PAD) + 6
        assert again.usage.cached_prompt_tokens >= image_end // 4 * 4
        assert encoder.encoded_images == 1
        other = generate(engine, chat(OTHER, question="Describe it."), max_tokens=2, temperature=0.0).final()
        first_pad = expanded_ids(engine.engine, chat(OTHER)).index(IMAGE_PAD)
        assert other.usage.cached_prompt_tokens <= first_pad  # the text before it at most
        assert encoder.encoded_images == 2
    finally:
        engine.shutdown()


def test_bytes_that_are_not_an_image_are_an_invalid_request(vl):
    path, _ = vl
    engine = make_engine(path)
    try:
        with pytest.raises(InvalidRequest) as e:
            generate(engine, chat(b"GIF89a but not really"), max_tokens=2)
        assert e.value.field == "chat.messages"
    finally:
        engine.shutdown()


def test_placeholder_tokens_without_an_image_are_refused_by_field(vl):
    path, _ = vl
    engine = make_engine(path)
    try:
        with pytest.raises(InvalidRequest) as e:
            generate(engine, [9707, IMAGE_PAD, 11], max_tokens=2)
        assert e.value.field == "token_ids" and "no image" in e.value.message
        assert len(generate(engine, [9707, 11, 1879], max_tokens=2, ignore_eos=True).token_ids()) == 2
    finally:
        engine.shutdown()


def test_language_model_only_refuses_images_and_answers_text(vl):
    path, _ = vl
    engine = make_engine(path, language_model_only=True)
    try:
        assert engine.engine.runner.model.visual is None
        with pytest.raises(InvalidRequest, match="does not accept images"):
            generate(engine, chat(WIDE), max_tokens=2)
        assert len(generate(engine, chat(question="Hello"), max_tokens=3, ignore_eos=True).token_ids()) == 3
    finally:
        engine.shutdown()


def test_preempted_image_requests_answer_as_transformers(vl):
    """Four image chats in a cache too small for all of them: preempted sequences prefill their
    prompt and output again, past-the-prompt positions keep their rope delta."""
    path, model = vl
    engine = make_engine(path, num_kv_blocks=10, max_model_len=160)  # 160 tokens of KV for 4 x ~60
    try:
        prompts = [chat(WIDE, question="One?"), chat(TALL, WIDE, question="Two?"), chat(OTHER, question="Three?"),
                   chat(TALL, question="Four?")]
        collectors = []
        for i, prompt in enumerate(prompts):
            collectors.append(Collector())
            engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                               collectors[-1])
        for prompt, collector in zip(prompts, collectors):
            collector.wait()
            assert collector.token_ids() == reference(path, model, prompt, expanded_ids(engine.engine, prompt), 24)
        assert engine.stats().preemptions > 0
    finally:
        engine.shutdown()


def test_traced_decode_steps_keep_the_rope_delta(tmp_path, demo_dir):
    """bf16 decodes through the traced CPU route (decode buckets) answer as the eager route does
    (Qwen3-VL: its bf16 logits are far from ties on this prompt; the hybrid fixture's are not)."""
    write_vl_model(tmp_path, demo_dir, "qwen3_vl")
    answers = []
    for eager in (False, True):
        engine = make_engine(tmp_path, dtype="bfloat16", enforce_eager=eager)
        try:
            assert (engine.engine.runner.decode_buckets is None) == eager
            answers.append(generate(engine, chat(WIDE, TALL), max_tokens=12, temperature=0.0,
                                    ignore_eos=True).token_ids())
        finally:
            engine.shutdown()
    assert answers[0] == answers[1]


@pytest.mark.parametrize("budget_mib", [64, 16])
def test_the_kv_cache_leaves_the_encoder_cache_room_in_the_budget(tmp_path, demo_dir, budget_mib):
    # The tower's output cache used to sit outside the budget the KV blocks are sized from: on a
    # GPU, a full cache could push the engine past --gpu-memory-utilization. It takes at most a
    # quarter of the budget (16 MiB: fewer than CACHE_TOKENS tokens).
    from xserv_engine.config import EngineConfig
    from xserv_engine.engine.engine_setup import EngineSetup
    from xserv_engine.multimodal.image_encoder import CACHE_TOKENS

    write_vl_model(tmp_path, demo_dir, "qwen3_vl")  # out_hidden_size 64, 2 DeepStack layers
    budget = budget_mib * 2**20
    blocks, capacity = {}, None
    for text_only in (False, True):
        config = EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", block_size=16,
                              kv_cache_memory_gb=budget / 2**30, language_model_only=text_only)
        setup = EngineSetup.build(config, progress=False)
        blocks[text_only] = setup.num_blocks
        block_bytes = setup.runner.kv_block_bytes()
        capacity = capacity or setup.runner.images.capacity
    per_token = 64 * (1 + 2) * 4
    assert capacity == min(CACHE_TOKENS, budget // 4 // per_token)
    assert blocks[True] == budget // block_bytes
    assert blocks[False] == (budget - capacity * per_token) // block_bytes < blocks[True]

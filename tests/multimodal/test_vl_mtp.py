"""method mtp on Qwen3.5 with its vision tower: the layer rotates by the target's positions (an
image prompt's MRoPE positions, its rope delta past the image), in the chunk and the draft steps."""

import types

import pytest
import torch

from tests.engine.conftest import generate, make_engine
from tests.engine.test_mtp import mtp
from tests.multimodal.test_vl_engine import chat, expanded_ids
from tests.support.hybrid_checkpoint import add_mtp_layer
from tests.support.vl_checkpoint import IMAGE_PAD, png, write_vl_model
from xserv_engine.engine.mtp_drafter import MtpDrafter
from xserv_engine.engine.sequence import Sequence
from xserv_engine.layers.attention import AttentionMetadata
from xserv_engine.sampling_params import SamplingParams

pytest.importorskip("transformers")

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_dir):
    """(transformers model, the engine, the image prompt, its ids as served, what mtp(2) proposed:
    (the sequence's tokens, its drafts) per proposal). Random weights accept next to none of the
    layer's drafts, and a sequence whose drafts miss proposes one at a time: so the drafts are
    recorded, then replaced by the target's own tokens (from a first run), which stand."""
    path = tmp_path_factory.mktemp("qwen3_5-vl-mtp")
    model = write_vl_model(path, demo_dir, "qwen3_5")
    add_mtp_layer(path, types.SimpleNamespace(config=model.config.text_config))
    prompt = chat(png(100, 70, seed=1), question="What is in this picture? Describe it.")
    proposed, full = [], []
    real_propose = MtpDrafter.propose

    def recording(self, seqs, rooms):
        drafts = real_propose(self, seqs, rooms)
        if full:
            proposed.extend((list(seq.token_ids), d) for seq, d in zip(seqs, drafts))
            drafts = [full[len(seq) : len(seq) + len(d)] for seq, d in zip(seqs, drafts)]
        return drafts

    patch = pytest.MonkeyPatch()
    patch.setattr(MtpDrafter, "propose", recording)
    engine = make_engine(path, speculative_config=mtp(2))
    try:
        ids = expanded_ids(engine.engine, prompt)
        answer = generate(engine, prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).token_ids()
        full.extend(ids + answer)
        again = generate(engine, prompt, max_tokens=MAX_TOKENS - 1, temperature=0.0, ignore_eos=True).token_ids()
        assert again == answer[:-1]
        model.name_or_path = str(path)  # where target_hidden finds the image processor
        yield model, engine, prompt, ids, proposed
    finally:
        engine.shutdown()
        patch.undo()


def target_hidden(model, prompt, token_ids: list[int]) -> torch.Tensor:
    """transformers' last hidden states [T, H] (after the final norm) of the image prompt's ids
    continued by token_ids' rest, its image through its own processor and positions."""
    import io

    import transformers
    from PIL import Image

    processor = transformers.AutoImageProcessor.from_pretrained(model.name_or_path)
    images = [Image.open(io.BytesIO(p["image"])) for p in prompt.messages[0]["content"] if p["type"] == "image"]
    pixels = processor(images=images, return_tensors="pt")
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        return model.model(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                           mm_token_type_ids=(ids == IMAGE_PAD).int()).last_hidden_state[0]


def layer_over(engine, prompt, next_tokens: list[int], hidden: torch.Tensor,
               delta: bool = True) -> tuple[torch.Tensor, list[int]]:
    """The engine's MTP layer called directly over positions 0..T-1 as one chunk (hidden [T, H]
    and next_tokens [T]: each position's target hidden state and the token after it), at the image
    prompt's MRoPE positions, past the prompt with its rope delta or without: its output [T, H] and
    greedy token at each position."""
    llm = engine.engine
    _, images = llm.generate_requests.image_prompts.expand(prompt, llm.generate_requests.tokenize(prompt)[0])
    T, prompt_len = len(hidden), images.positions.shape[1]
    positions = images.positions_of(0, T).clone()
    if not delta:
        positions[:, prompt_len:] -= images.rope_delta
    runner = llm.runner
    seq = Sequence([0] * (T + 1), SamplingParams(), runner.block_size)
    llm.block_manager.allocate(seq)
    try:
        meta = AttentionMetadata(slot_mapping=runner.tensor(runner.slots(seq, 0, T), torch.int64),
                                 num_prefill_tokens=T, prefill=runner.prefill_metadata([seq], [0], [T]))
        runner.backend.prepare(meta, runner.block_size)
        with torch.inference_mode():
            out = runner.model.draft(torch.tensor(next_tokens), positions, hidden, meta)
            return out, runner.model.compute_logits(out).argmax(-1).tolist()
    finally:
        llm.block_manager.deallocate(seq)


def test_first_drafts_after_an_image_prompt_are_the_layers_at_the_targets_positions(served):
    """Each first draft equals the layer's greedy token at the position before the sequence's
    last token, over the whole sequence at the target's MRoPE positions; without the rope delta
    past the image some of them differ."""
    model, engine, prompt, ids, proposed = served
    assert ids.count(IMAGE_PAD) == 6 and len(proposed) >= MAX_TOKENS // 4
    full = max((tokens for tokens, _ in proposed), key=len)
    hidden = target_hidden(model, prompt, full[:-1])
    _, want = layer_over(engine, prompt, full[1:], hidden)
    for tokens, drafts in proposed:
        assert drafts[0] == want[len(tokens) - 2], len(tokens)
    _, without_delta = layer_over(engine, prompt, full[1:], hidden, delta=False)
    assert without_delta[len(ids) - 1:] != want[len(ids) - 1:]


def test_second_drafts_are_the_layer_one_position_on_with_the_rope_delta(served):
    """Each proposal's second draft is the layer at the next position, fed its own output and the
    first draft: the layer over the sequence continued by that draft, as one chunk."""
    model, engine, prompt, _, proposed = served
    pairs = [(tokens, drafts) for tokens, drafts in proposed if len(drafts) == 2]
    assert len(pairs) >= MAX_TOKENS // 4
    for tokens, drafts in pairs:
        hidden = target_hidden(model, prompt, tokens[:-1])  # [len - 1, H]
        out, first = layer_over(engine, prompt, tokens[1:], hidden)
        _, second = layer_over(engine, prompt, tokens[1:] + [drafts[0]], torch.cat([hidden, out[-1:]]))
        assert [first[-1], second[-1]] == drafts, len(tokens)

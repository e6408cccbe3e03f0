"""A constrained row that allows few tokens is drawn among its allowed ids instead of through a
masked vocabulary-wide row: it must draw exactly what the masked row would, whatever the sampling
parameters. Rows that ask for logprobs always take the masked path, so they are the reference."""

import numpy as np
import pytest
import torch

from tests.structured.conftest import EOS_IDS, PREFIXES, person_rows
from xserv_engine.engine.sequence import Sequence
from xserv_engine.layers import native, ops
from xserv_engine.layers.sampler import Sampler
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.bitmask import allowed_ids, apply_bitmask, count_allowed
from xserv_engine.structured.manager import StructuredOutputManager
from xserv_engine.tokenizer.tokenizer import Tokenizer

VOCAB = 151936  # the model's logits, wider than the tokenizer
PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5, logit_bias={90: 5.0, 15: -3.0}),
]


@pytest.fixture(scope="module")
def manager(demo_dir):
    return StructuredOutputManager(demo_dir / "tokenizer.json", EOS_IDS, separator_ids=())


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return Tokenizer.from_dir(demo_dir)


def guided_batch(manager, tokenizer, logprobs: bool) -> list[Sequence]:
    return person_rows(manager, tokenizer, PARAMS, logprobs=logprobs, top_logprobs=2 if logprobs else 0)


def test_a_narrowed_row_draws_what_the_masked_row_draws(manager, tokenizer, monkeypatch):
    # both sides masked before their draws: rows drawn first (test_drawn_first.py) take another
    # number from their generator when refused, so seeded draws would part
    monkeypatch.setattr("xserv_engine.structured.manager.mask_first", lambda seq: True)
    logits = 4 * torch.randn(len(PREFIXES) * len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(0))
    narrowed_seqs, masked_seqs = guided_batch(manager, tokenizer, False), guided_batch(manager, tokenizer, True)
    rows = list(range(len(narrowed_seqs)))
    candidates = manager.apply(logits.clone(), rows, [s.guide for s in narrowed_seqs], narrowable=[True] * len(rows))
    assert len(candidates.rows) == len(rows) - len(PARAMS)  # all but the string's rows are narrowed
    for _ in range(3):  # three steps: the seeded generators move on
        narrowed = Sampler(EOS_IDS)(logits.clone(), narrowed_seqs).token_ids
        masked = Sampler(EOS_IDS)(logits.clone(), masked_seqs).token_ids
        assert narrowed == masked
        for seqs in (narrowed_seqs, masked_seqs):
            for seq, token_id in zip(seqs, narrowed):
                seq.append_token(token_id)
                seq.guide.accept(token_id)  # GrammarViolation if the mask let a blocked token through
    assert len(set(narrowed)) > len(PREFIXES)  # drawn, not one forced token per prefix


@pytest.mark.parametrize("native_op", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("vocab_past_mask", [-10, 0, 64])  # the model's vocabulary: within the mask, or past it
def test_allowed_ids_and_counts_list_every_set_bit_below_the_vocabulary_in_order(native_op, vocab_past_mask):
    if native_op and not native.load_torch_ops():
        pytest.skip("the native CPU ops need a C++ compiler (g++ or $CXX); the numpy path runs here")
    rng = np.random.default_rng(0)
    words = 40
    vocab = words * 32 + vocab_past_mask
    bits = np.zeros((6, words * 32), dtype=bool)
    bits[0, [0, 31, 32, 700]] = True
    bits[1, rng.choice(min(vocab, words * 32), 300, replace=False)] = True
    bits[2, words * 32 - 1] = True  # beyond the vocabulary when it ends inside the mask
    bits[3, 5] = True
    bits[5, :] = True
    bitmask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    rows = [3, 1, 0, 2, 4]
    ids, valid = allowed_ids(bitmask, rows, vocab, native_op)
    assert (ids.dtype, valid.dtype) == (torch.int64, torch.bool)
    for j, row in enumerate(rows):
        expected = np.flatnonzero(bits[row, :vocab])
        assert ids[j][valid[j]].tolist() == expected.tolist()
        assert not ids[j][~valid[j]].any()  # the padding is id 0
    assert ids.shape[1] == 300  # padded to the longest row
    assert count_allowed(bitmask, native_op).tolist() == bits.sum(axis=1).tolist()
    empty_ids, empty_valid = allowed_ids(bitmask, [4], vocab, native_op)  # a row that allows nothing
    assert empty_ids.shape == (1, 1) and not empty_valid.any()


@pytest.mark.parametrize("native_op", [True, False], ids=["native", "numpy"])
def test_apply_bitmask_masks_the_given_rows_only(native_op):
    if native_op and not native.load_torch_ops():
        pytest.skip("the native CPU ops need a C++ compiler (g++ or $CXX); the numpy path runs here")
    rng = np.random.default_rng(1)
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(3, 40), dtype=np.int32)
    bitmask[0, :4] = -1  # words that allow all 32 tokens, and words that allow none
    bitmask[1, 4:9] = 0
    logits = torch.randn(6, 40 * 32 + 7)
    expected = logits.clone()
    rows = [5, 0, 3]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    for j, row in enumerate(rows):
        expected[row, :40 * 32][torch.from_numpy(~bits[j])] = float("-inf")
        expected[row, 40 * 32:] = float("-inf")  # the padded vocabulary: never allowed
    ops.set_native(native_op)
    try:
        apply_bitmask(logits, bitmask, rows)
    finally:
        ops.set_native(False)
    assert torch.equal(logits, expected)

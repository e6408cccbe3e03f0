"""Structured-output fixtures: the demo model (random weights, the real Qwen vocabulary) is the
best adversary: without the mask it never writes JSON, so every valid answer is the mask's work."""

from dataclasses import replace

import pytest

from tests.engine.conftest import make_engine
from tests.structured.schemas import PERSON_JSON
from tests.tokenizer.test_chat_tokens import QWEN3_TOKENS
from xserv_engine.engine.sequence import Sequence
from xserv_engine.structured.constraint import JSON_SCHEMA, Constraint
from xserv_engine.structured.llguidance_backend import LLGuidanceBackend

EOS_IDS = [151645, 151643]
# where a PERSON answer can stand: forced '{', a bounded string (thousands allowed), digits, an enum
PREFIXES = ['', '{"name":"', '{"name":"Ada","age":', '{"name":"Ada","age":36,"role":"', '{"name":"Ada","age":3']


def person_rows(manager, tokenizer, params: list, copies: int = 1, **fields) -> list[Sequence]:
    """Sequences held to the PERSON schema, one per PREFIXES x params x copies, each advanced
    over its prefix; row i is seeded with i (and gets `fields`)."""
    grammar = manager.compile(Constraint(JSON_SCHEMA, PERSON_JSON))
    seqs = []
    for i, (prefix, p) in enumerate((a, b) for a in PREFIXES for b in params for _ in range(copies)):
        seq = Sequence([9707, 11, 1879], replace(p, seed=i, **fields), 16)
        seq.guide = manager.guide(grammar, seq.token_ids, is_chat=False, tokens=QWEN3_TOKENS)
        for token_id in tokenizer.encode(prefix):
            seq.append_token(token_id)
            seq.guide.accept(token_id)
        seqs.append(seq)
    return seqs


@pytest.fixture(scope="session")
def backend(demo_dir):
    return LLGuidanceBackend((demo_dir / "tokenizer.json").read_text(), EOS_IDS)


@pytest.fixture(scope="module")
def engine(demo_dir):
    # the served dtype (bf16 where the CPU has it): the answers are checked for their structure, and
    # an fp32 head over 151,936 tokens made each step twice as slow (9.2 -> 6.3 s of CPU, test_engine.py)
    engine = make_engine(demo_dir, max_model_len=1024, num_kv_blocks=512, dtype="auto")
    yield engine
    engine.shutdown()

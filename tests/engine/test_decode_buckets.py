"""Decode steps padded to batch-size buckets over preallocated buffers (decode_buckets.py).

On CUDA each bucket is a captured graph; capturing needs a GPU, but the padding, the buffers
and the scratch block are the same code uncaptured, and run here on the CPU: generation must
not change by a token.
"""


from tests.engine.conftest import Collector, make_engine, wait_idle
from xserv_engine.engine.decode_buckets import BucketedDecode, batch_buckets
from xserv_engine.sampling_params import SamplingParams


def test_buckets_cover_every_batch_up_to_the_limit():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256]


def _workload(engine):
    """Five concurrent greedy streams of different prompt and output lengths: the batch shrinks
    5 -> 1 as they finish, through buckets 8, 4, 2 and 1."""
    collectors = []
    for i, (n, max_tokens) in enumerate([(5, 9), (40, 14), (17, 4), (70, 20), (3, 11)]):
        collectors.append(Collector())
        prompt = list(range(2000 + 100 * i, 2000 + 100 * i + n))
        engine.add_request(f"b-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           collectors[-1])
    tokens = [c.wait() and c.token_ids() for c in collectors]
    wait_idle(engine)  # every block back, the scratch block never handed out
    return tokens


def test_bucketed_decode_generates_what_the_plain_step_does(tied_model_dir, monkeypatch):
    plain = make_engine(tied_model_dir)
    try:
        expected = _workload(plain)
    finally:
        plain.shutdown()
    batches = []
    original = BucketedDecode.run
    monkeypatch.setattr(BucketedDecode, "run", lambda self, seqs: batches.append(len(seqs)) or original(self, seqs))
    engine = make_engine(tied_model_dir)
    try:
        engine.runner.use_bucketed_decode(max_num_seqs=8, max_model_len=engine.setup.max_model_len, capture=False)
        got = _workload(engine)
    finally:
        engine.shutdown()
    assert got == expected
    assert {5, 3, 1} <= set(batches)  # padded to 8 and 4, and unpadded

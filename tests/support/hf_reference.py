"""transformers' greedy continuation, the reference most engine tests compare xserv's tokens with.

`greedy_tokens(model, prompt, n)` returns what `model.generate(prompt, max_new_tokens=n,
min_new_tokens=n, do_sample=False)` returns after the prompt: n steps of the model's own forward
with its own cache, each taking the argmax of the last position's logits with the end-of-sequence
ids at -inf (min_new_tokens keeps them out of all n steps). It skips generate's per-step machinery
(its min-length processors scan the 151,936-token vocabulary with torch.isin every step, stopping
criteria, cache set-up), which costs the tests' tiny models more than their forward does.
tests/engine/test_hybrid_models.py checks that both give the same tokens on a Qwen3 and a
Qwen3.5 model.

Requests with images stay on generate, which prepares their inputs and mrope positions itself.

`auto_tokenizer(path)`: transformers' AutoTokenizer of a directory, loaded once per process.
"""

import functools

import torch

# generation_config fields that leave greedy decoding alone; any other (a repetition penalty,
# suppressed tokens, ...) would make generate() differ from the loop below
_NEUTRAL = {"use_cache", "output_attentions", "output_hidden_states", "bos_token_id", "eos_token_id",
            "pad_token_id", "_from_model_config", "transformers_version"}


def _eos_ids(model) -> list[int]:
    config = model.generation_config
    if unsupported := set(config.to_diff_dict()) - _NEUTRAL:
        raise ValueError(f"greedy_tokens does not apply generation_config fields {sorted(unsupported)}; "
                         "use model.generate")
    eos = config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def greedy_tokens(model, prompt, n: int) -> list[int]:
    """The n tokens transformers' greedy generate() appends to prompt (a list of ids), none of
    them an end-of-sequence id."""
    eos = _eos_ids(model)
    step_ids = torch.tensor([list(prompt)])
    mask = torch.ones_like(step_ids)
    cache, tokens = None, []
    with torch.no_grad():
        for _ in range(n):
            out = model(input_ids=step_ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
            logits = out.logits[0, -1].float()  # [vocab]
            logits[eos] = -float("inf")
            tokens.append(int(logits.argmax()))
            step_ids = torch.tensor([[tokens[-1]]])
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
    return tokens


def auto_tokenizer(path):
    """transformers' AutoTokenizer of the model directory path, loaded once per process: several
    modules compare with one directory's tokenizer, and none of them changes it."""
    return _tokenizer(str(path))


@functools.cache
def _tokenizer(path: str):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)

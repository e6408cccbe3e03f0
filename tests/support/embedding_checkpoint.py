"""Writes a random-weight embedding checkpoint in Qwen/Qwen3-Embedding-0.6B's layout: a
sentence-transformers directory (modules.json; 1_Pooling/config.json with last-token pooling;
a Normalize module) around transformers' Qwen3Model saved alone - tensors named without
"model.", no LM head - whose tokenizer appends <|endoftext|> to every text (its post-processor),
the token whose final hidden state is the embedding."""

import json
from pathlib import Path

import torch

from tests.support.build_cache import cached_model, checkpoint_inputs
from tests.support.hybrid_checkpoint import copy_tokenizer, tokenizer_files

ENDOFTEXT = "<|endoftext|>"
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def write_embedding_checkpoint(path: Path, demo_dir: Path, normalize: bool = True, seed: int = 0):
    """The directory's transformers Qwen3Model (fp32, eval), as the reference computes with it:
    written into path, or copied from the tests' build cache when it holds it."""
    def write(out: Path):
        from tokenizers import Tokenizer, processors
        from transformers import Qwen3Model

        from tests.engine.conftest import tiny_qwen3_config

        torch.manual_seed(seed)
        cfg = tiny_qwen3_config(tie=True, eos_token_id=151643)
        Qwen3Model(cfg).eval().save_pretrained(out)
        config = json.loads((out / "config.json").read_text())
        config["architectures"] = ["Qwen3ForCausalLM"]  # what Qwen's release says, though it holds no head
        (out / "config.json").write_text(json.dumps(config, indent=2))
        copy_tokenizer(demo_dir, out)
        tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
        eot = tokenizer.token_to_id(ENDOFTEXT)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"$A {ENDOFTEXT}", pair=f"$A {ENDOFTEXT} $B:1 {ENDOFTEXT}:1", special_tokens=[(ENDOFTEXT, eot)])
        tokenizer.save(str(out / "tokenizer.json"))
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
            (out / "2_Normalize").mkdir()
        (out / "modules.json").write_text(json.dumps(modules, indent=2))
        (out / "1_Pooling").mkdir()
        (out / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": cfg.hidden_size, "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": True, "include_prompt": True}, indent=2))
        (out / "config_sentence_transformers.json").write_text(json.dumps({
            "prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
            "similarity_fn_name": "cosine"}, indent=2))
        (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 1024, "do_lower_case": False}))

    inputs = checkpoint_inputs(write_embedding_checkpoint, *tokenizer_files(demo_dir),
                               repr((normalize, seed)))
    name = f"embedding-{'normalized' if normalize else 'plain'}-seed{seed}"
    return cached_model(path, name, inputs, write, "Qwen3Model")

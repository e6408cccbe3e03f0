"""The multi-token-prediction layer of Qwen3.5, Qwen3.5-MoE and Qwen3-Next (`mtp.*`): the
checkpoint's own drafter, as vLLM serves it (`{"method": "mtp"}`).

From the target's hidden state h_i at position i (its last layer's output after the final norm:
what the LM head reads) and the embedding of token i + 1, it predicts token i + 2:

    x = fc([pre_fc_norm_embedding(embed(t_{i+1})); pre_fc_norm_hidden(h_i)])   # [T, 2H] -> [T, H]
    out = norm(decoder_layer(x))                                              # at position i

with the target's embedding, rotary tables and LM head, and one full-attention decoder layer of
the target's kind (the gated attention; a dense MLP or the experts, as the target's layers have),
whose KV lives beside the target's, indexed by the same block tables. Drafting k tokens applies
it again on its own output, one position further each time. The norms are zero-centred in the
checkpoint; the loader stores 1 + w, as for the target's.
"""

import torch
from torch import nn

from xserv_engine.layers import ops
from xserv_engine.layers.attention import AttentionBackend, AttentionMetadata
from xserv_engine.layers.layernorm import RMSNorm


class MultiTokenPredictor(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, decoder_layer, linear):
        """decoder_layer(cfg, backend, index), linear(in, out): models/qwen3.py's, so that the
        layer is the target's own kind (index past the target's layers: full attention)."""
        super().__init__()
        hidden = cfg.hidden_size
        self.fc = linear(2 * hidden, hidden)
        self.pre_fc_norm_embedding = RMSNorm(hidden, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(decoder_layer(cfg, backend, cfg.num_hidden_layers + i)
                                    for i in range(cfg.mtp_num_hidden_layers))
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor, rope: ops.Rope, meta: AttentionMetadata,
                step: int = 0) -> torch.Tensor:
        """embeddings [T, H] of the tokens after the hidden states' positions, hidden [T, H] ->
        the predictor's hidden states [T, H] (for the LM head, and for the next draft step)."""
        e, h = self.pre_fc_norm_embedding, self.pre_fc_norm_hidden
        x = self.fc(torch.cat([ops.rms_norm(embeddings, e.weight, e.eps), ops.rms_norm(hidden, h.weight, h.eps)], -1))
        x, residual = self.layers[step % len(self.layers)](rope, x, None, meta)
        return ops.add_rms_norm(residual, x, self.norm.weight, self.norm.eps)[1]

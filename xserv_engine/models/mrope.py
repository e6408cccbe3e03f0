"""MRoPE positions of a prompt with images (transformers' Qwen3VLModel.get_rope_index, one
sequence): text tokens count up on all three axes; an image's tokens, a grid of
(t, h / merge, w / merge), take (start + t_i, start + h_i, start + w_i); the text after it resumes
at start + max(h, w) / merge. Past the prompt every axis is the token's index plus the sequence's
rope delta (the last prompt position + 1 - the prompt's length), so decoding needs nothing else.
"""

import torch


def mrope_positions(token_ids: list[int], grids: list[tuple[int, int, int]], image_token_id: int,
                    merge_size: int) -> tuple[torch.Tensor, int]:
    """([3, len(token_ids)] int64 positions, rope delta). Each run of image_token_id is the next
    image of grids, already expanded to its t * h * w / merge**2 tokens."""
    rows: list[torch.Tensor] = []
    images = iter(grids)
    start = i = 0
    n = len(token_ids)
    while i < n:
        j = i
        if token_ids[i] != image_token_id:
            while j < n and token_ids[j] != image_token_id:
                j += 1
            rows.append(torch.arange(start, start + j - i).expand(3, -1))
            start += j - i
        else:
            t, h, w = next(images)
            h, w = h // merge_size, w // merge_size
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            rows.append(grid.reshape(3, -1) + start)
            j = i + t * h * w
            start += max(h, w)
        i = j
    positions = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.int64)
    delta = int(positions.max()) + 1 - n if n else 0
    return positions, delta

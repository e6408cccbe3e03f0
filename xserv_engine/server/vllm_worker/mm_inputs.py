"""SMG's mm_inputs (the router preprocessed the images itself) -> TokenImages of RouterPatches.

The layout, as smg 1.13 sends it for Qwen3-VL / Qwen3.5: `tokenized.input_ids` already expanded
(each image's run of <|image_pad|>, `im_token_id`, at its `mm_placeholders` offset and length);
`pixel_values` the images' patches back to back, [sum of t * h * w, C * T * P * P] float32 inline,
split per image by the sizes tensor `flat_keys["pixel_values"]` names (`patches_per_image`);
`model_specific_tensors["image_grid_thw"]` [images, 3] int64; `mm_hashes` one content hash per
image. The engine folds each run back to one placeholder, so the prompt goes through the same
expansion, MRoPE positions and checks as any image prompt, with the router's patches in place of
its own preprocessing and the router's hash as the cache key.
"""

import hashlib

import numpy as np
import torch
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import common_pb2

from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import TokenImages
from xserv_engine.multimodal.image_processor import RouterPatches

FIELD = "mm_inputs"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
           "int32": torch.int32, "uint32": torch.uint32}


def token_images_from_pb(mm: pb.MultimodalInputs, input_ids: list[int]) -> TokenImages:
    if mm.modality not in (common_pb2.MODALITY_UNSPECIFIED, common_pb2.IMAGE):
        raise InvalidRequest(f"{FIELD}.modality", f"{common_pb2.Modality.Name(mm.modality)} is not supported by "
                                                  "this engine; it takes images only")
    if mm.HasField("encoder_input_key") and mm.encoder_input_key != "pixel_values":
        raise InvalidRequest(f"{FIELD}.encoder_input_key", "this engine's tower takes pixel_values")
    if "image_grid_thw" not in mm.model_specific_tensors:
        raise InvalidRequest(f"{FIELD}.model_specific_tensors", "image_grid_thw is missing")
    grids = [tuple(int(x) for x in row) for row in _tensor(mm.model_specific_tensors["image_grid_thw"],
                                                           f"{FIELD}.model_specific_tensors[image_grid_thw]").tolist()]
    count = len(grids)
    if len(mm.mm_placeholders) != count or (mm.mm_hashes and len(mm.mm_hashes) != count):
        raise InvalidRequest(f"{FIELD}.mm_placeholders", f"{len(mm.mm_placeholders)} placeholder(s) and "
                                                         f"{len(mm.mm_hashes)} hash(es) for {count} image grid(s)")
    pixels = _tensor(mm.pixel_values, f"{FIELD}.pixel_values").float()
    pixels = pixels.reshape(-1, pixels.shape[-1]) if pixels.dim() == 3 else pixels  # batched: [images, rows, dim]
    sizes = [t * h * w for t, h, w in grids]
    sizes_key = mm.flat_keys.get("pixel_values")
    if sizes_key and sizes_key in mm.model_specific_tensors:
        sent = _tensor(mm.model_specific_tensors[sizes_key], f"{FIELD}.model_specific_tensors[{sizes_key}]")
        if sent.flatten().tolist() != sizes:
            raise InvalidRequest(f"{FIELD}.model_specific_tensors", f"{sizes_key} {sent.flatten().tolist()} does "
                                                                    f"not match image_grid_thw ({sizes} patches)")
    if pixels.dim() != 2 or pixels.shape[0] != sum(sizes):
        raise InvalidRequest(f"{FIELD}.pixel_values", f"shape {tuple(pixels.shape)} does not hold the {sum(sizes)} "
                                                      "patches of image_grid_thw")
    ranges = [(p.offset, p.length) for p in mm.mm_placeholders]
    ids = _folded(input_ids, ranges, mm.im_token_id if mm.HasField("im_token_id") else None)
    images = tuple(RouterPatches(patches, grid, "mm:" + (mm.mm_hashes[k] if mm.mm_hashes else _digest(patches, grid)),
                                 length)
                   for k, (patches, grid, (_, length)) in enumerate(zip(pixels.split(sizes), grids, ranges)))
    return TokenImages(ids, images, FIELD)


def _tensor(data: pb.TensorData, field: str) -> torch.Tensor:
    if data.WhichOneof("payload") is None:
        raise InvalidRequest(field, "is missing")
    if data.WhichOneof("payload") != "inline":
        raise InvalidRequest(field, "only inline tensors are supported by this engine (no shm or remote handles)")
    dtype = _DTYPES.get(data.dtype)
    if dtype is None:
        raise InvalidRequest(field, f"dtype {data.dtype!r} is not one of {', '.join(_DTYPES)}")
    shape = tuple(data.shape)
    if len(data.inline) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise InvalidRequest(field, f"{len(data.inline)} bytes do not hold shape {list(shape)} of {data.dtype}")
    return torch.frombuffer(bytearray(data.inline), dtype=dtype).reshape(shape)


def _folded(input_ids: list[int], ranges: list[tuple[int, int]], image_token_id: int | None) -> list[int]:
    """input_ids with each placeholder run folded back to its first token."""
    folded, at = [], 0
    for k, (offset, length) in enumerate(ranges):
        run = input_ids[offset : offset + length]
        if offset < at or length < 1 or len(run) != length or (
                image_token_id is not None and any(t != image_token_id for t in run)):
            raise InvalidRequest(f"{FIELD}.mm_placeholders", f"placeholder {k} (offset {offset}, length {length}) "
                                                             "is not a run of image tokens in order in input_ids")
        folded += input_ids[at : offset + 1]
        at = offset + length
    return folded + input_ids[at:]


def _digest(patches: torch.Tensor, grid: tuple[int, int, int]) -> str:
    return hashlib.sha256(repr(grid).encode() + patches.numpy().tobytes()).hexdigest()

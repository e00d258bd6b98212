"""Token-id rows and batches, shared by the tokenizer and the model: reading ids from ints, lists, tensors and arrays,
and padding rows into [batch pos] ids with their attention mask (transformers' `pad` included)."""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Optional, Sequence, Union

import torch

PADDING_SIDES = ("right", "left")
TokenIds = Union[int, Sequence[int], torch.Tensor]


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int, padding_side: str, length: Optional[int] = None):
    """Id rows as one [batch length] long tensor padded with `pad_id` on `padding_side`, and its mask (1 = real)."""
    check_padding_side(padding_side)
    length = max(len(row) for row in rows) if length is None else length
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if padding_side == "right" else slice(length - len(row), length)
        ids[i, span] = torch.tensor(list(row), dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


def pad_encodings(encoded_inputs, pad_id: int, padding_side: str, padding: Union[bool, str] = True,
                  max_length: Optional[int] = None, pad_to_multiple_of: Optional[int] = None,
                  return_attention_mask: bool = True, return_tensors: Optional[str] = None) -> dict:
    """transformers' `tokenizer.pad`: a list of encodings ({"input_ids": ...}), or one encoding of id lists, padded
    to one length with `pad_id`, attention_mask 0 on the padding. Other keys pass through unpadded."""
    if isinstance(encoded_inputs, (list, tuple)) and encoded_inputs and isinstance(encoded_inputs[0], Mapping):
        batch = {key: [item[key] for item in encoded_inputs] for key in encoded_inputs[0]}
    elif isinstance(encoded_inputs, Mapping):
        batch = dict(encoded_inputs)
    else:
        raise TypeError("pad takes a list of encodings ({'input_ids': [...]}) or one encoding of id lists, "
                        f"got {type(encoded_inputs).__name__}")
    if "input_ids" not in batch or len(batch["input_ids"]) == 0:
        raise ValueError(f"pad needs non-empty input_ids; the encodings have {sorted(batch)}")
    ids = batch["input_ids"]
    first = ids if isinstance(ids, torch.Tensor) else ids[0]
    if return_tensors is None and isinstance(first, torch.Tensor):
        return_tensors = "pt"  # tensors in, tensors out, as transformers infers
    single = is_int(ids[0]) or (isinstance(ids, torch.Tensor) and ids.dim() == 1)
    rows = [id_list(row, "pad") for row in ([ids] if single else ids)]
    masks = batch.get("attention_mask")
    masks = [[1] * len(row) for row in rows] if masks is None else [id_list(m, "pad") for m in ([masks] if single else masks)]
    if padding in (True, "longest", "max_length"):
        length = max_length if padding == "max_length" and max_length is not None else max(map(len, rows))
        if pad_to_multiple_of:
            length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
        left = check_padding_side(padding_side) == "left"
        fill = lambda row, value: [value] * (length - len(row)) + row if left else row + [value] * (length - len(row))
        rows, masks = [fill(row, pad_id) for row in rows], [fill(mask, 0) for mask in masks]
    elif padding not in (False, "do_not_pad"):
        raise ValueError(f"padding={padding!r} is not one of True, False, 'longest', 'max_length', 'do_not_pad'")
    batch["input_ids"] = rows[0] if single else rows
    batch.pop("attention_mask", None)
    if return_attention_mask:
        batch["attention_mask"] = masks[0] if single else masks
    if return_tensors is not None:
        batch = {key: as_array([value] if single else value, return_tensors) if key in ("input_ids", "attention_mask")
                 else torch.as_tensor(value) if return_tensors == "pt" else value for key, value in batch.items()}
    return batch


def as_array(rows: list[list[int]], kind: str):
    """Equal-length id rows as a [batch pos] torch ("pt") or numpy ("np") int64 array."""
    if len({len(row) for row in rows}) > 1:
        raise ValueError("these texts have different lengths, so they make no [batch pos] tensor: pass padding=True")
    ids = torch.tensor(rows, dtype=torch.long)
    return ids.numpy() if kind == "np" else ids


def check_padding_side(side: str) -> str:
    if side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be 'right' or 'left', got {side!r}")
    return side


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def id_list(ids: TokenIds, where: str) -> list[int]:
    """An id, a list of ids or a 0-d / 1-d integer tensor or array as a list of ints."""
    if is_int(ids):
        return [int(ids)]
    if isinstance(ids, torch.Tensor) or hasattr(ids, "__array__"):
        ids = torch.as_tensor(ids)
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"{where} takes integer token ids, got dtype {ids.dtype}")
        if ids.dim() > 1:
            raise ValueError(f"{where} takes one sequence, got ids of shape {tuple(ids.shape)}; "
                             "use batch_decode (or model.to_string) for a batch")
        return ids.reshape(-1).tolist()
    ids = list(ids)
    if not all(is_int(i) for i in ids):
        raise TypeError(f"{where} takes token ids (ints); got {[type(i).__name__ for i in ids][:5]}")
    return [int(i) for i in ids]

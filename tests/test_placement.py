"""probe.placement: the bytes of each part against a count by hand from the config, the plan's arithmetic, and a
dispatched model computing what the undivided one does (CPU-only splits here; tests/test_gpu.py splits a model
between the CPU and a GPU where there is one)."""
from __future__ import annotations

import pytest
import torch

from probe import DecoderConfig, HookedDecoder
from probe.placement import dispatch, normalise_device_map, parse_bytes, part_sizes

LLAMA_70B = dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_vocab=128256, n_ctx=8192, d_mlp=28672,
                 activation="silu", gated_mlp=True, norm="rms", positions="rotary", qkv_bias=False, out_bias=False,
                 mlp_bias=False, tied_embeddings=False)


def _llama_block_floats(d, heads, kv_heads, d_head, d_mlp):
    """Parameters of one Llama block, by hand: two RMSNorm weights, q/k/v/o, a gated MLP's three matrices,
    and rotary's inverse frequencies (one per pair of dimensions)."""
    return 2 * d + d * (heads + 2 * kv_heads) * d_head + heads * d_head * d + 3 * d * d_mlp + d_head // 2


def test_a_70b_config_is_sized_on_the_meta_device_as_counted_by_hand():
    cfg = DecoderConfig(**LLAMA_70B)
    sizes = part_sizes(HookedDecoder, cfg, torch.bfloat16)
    block = _llama_block_floats(8192, 64, 8, 128, 28672) * 2
    assert sizes.blocks == (block,) * 80
    assert sizes.embed == 128256 * 8192 * 2
    assert sizes.head == (8192 + 128256 * 8192) * 2  # final RMSNorm + its own unembedding
    assert 70.5e9 < sizes.total / 2 < 70.6e9  # Llama-3-70B's published 70.6B parameters


def test_the_plan_fills_devices_in_layer_order():
    cfg = DecoderConfig(**{**LLAMA_70B, "n_layers": 16})  # 70B's blocks, fewer of them: planning is not slow
    sizes = part_sizes(HookedDecoder, cfg, torch.bfloat16)
    per_gpu = 8 * 2**30
    plan = HookedDecoder.plan_device_map(cfg, {"cuda:0": per_gpu, "cuda:1": per_gpu, "cuda:2": per_gpu, "cuda:3": per_gpu},
                           dtype=torch.bfloat16)
    # by hand: the embedding and as many whole blocks as fit go on cuda:0, and so on
    first = (per_gpu - sizes.embed) // sizes.blocks[0]
    assert [plan[f"blocks.{i}"] for i in range(16)][: first + 1] == ["cuda:0"] * first + ["cuda:1"]
    per_device = per_gpu // sizes.blocks[0]
    last_block_device = f"cuda:{1 + (16 - first - 1) // per_device}"
    assert plan["blocks.15"] == last_block_device
    assert plan["embed"] == "cuda:0"
    assert plan["head"] in (last_block_device, f"cuda:{int(last_block_device[-1]) + 1}")
    with pytest.raises(ValueError, match="GiB short"):
        HookedDecoder.plan_device_map(cfg, {"cuda:0": "8GiB", "cuda:1": "8GiB"}, dtype=torch.bfloat16)


def test_memory_amounts_and_maps_are_read_strictly():
    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("512 MB") == 512 * 10**6 and parse_bytes(1024) == 1024
    with pytest.raises(ValueError, match="not understood"):
        parse_bytes("lots")
    assert normalise_device_map({0: "cpu", 1: "cpu"}, 2) == {"blocks.0": "cpu", "blocks.1": "cpu", "embed": "cpu", "head": "cpu"}
    with pytest.raises(ValueError, match="blocks.1"):
        normalise_device_map({0: "cpu"}, 2)
    with pytest.raises(ValueError, match="not a part"):
        normalise_device_map({0: "cpu", 1: "cpu", "lm_head": "cpu"}, 2)


def test_a_dispatched_model_computes_what_the_whole_one_does(tiny_dir):
    whole = HookedDecoder.from_pretrained(tiny_dir)
    split = HookedDecoder.from_pretrained(tiny_dir, device_map={0: "cpu", 1: "cpu"})
    tokens = torch.randint(0, whole.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(split(tokens), whole(tokens), rtol=0, atol=0)
    assert len(split.placement.handles) == 2 + 2 + 2  # embedding (token + position), two blocks, norm + unembedding
    _, cache = split.run_with_cache(tokens)
    _, expected = whole.run_with_cache(tokens)
    torch.testing.assert_close(cache["blocks.1.hook_resid_post"], expected["blocks.1.hook_resid_post"], rtol=0, atol=0)
    split.placement.remove()
    assert not split.placement.handles and not any(m._forward_pre_hooks for m in split.modules())
    with pytest.raises(ValueError, match="not both"):
        HookedDecoder.from_pretrained(tiny_dir, device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="tied"):
        dispatch(whole, {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "head": "meta"})

"""Weights edited by transformer-lens's names (probe/tl_weights.py), as abliteration, model editing and weight
surgery write them, against transformers' GPT-2 with the same edit made to its own parameters."""
from __future__ import annotations

import copy

import pytest
import torch

P = torch.tensor([[5, 17, 3, 42, 8, 11, 2, 30]])


def orthogonalized(W: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    # the refusal-direction edit: remove each row's component along the direction (written as Arditi et al.'s)
    return W - (W @ direction)[..., None] * direction


@pytest.fixture
def pair(tiny_model, tiny_hf):
    return copy.deepcopy(tiny_model), copy.deepcopy(tiny_hf)


def logits_agree(ours, hf):
    with torch.no_grad():
        torch.testing.assert_close(ours(P), hf(P).logits, rtol=0, atol=1e-4)


def test_assigning_data_writes_through_as_abliteration_does(pair):
    ours, hf = pair
    d = torch.randn(ours.cfg.d_model, generator=torch.Generator().manual_seed(0))
    d /= d.norm()
    before = ours(P).detach()
    for l, block in enumerate(ours.blocks):
        block.attn.W_O.data = orthogonalized(block.attn.W_O, d)  # [head d_head d_model]
        block.mlp.W_out.data = orthogonalized(block.mlp.W_out, d)  # [d_mlp d_model]
        theirs = hf.transformer.h[l]
        with torch.no_grad():  # GPT-2's Conv1D weights are [in out]: the writes to the residual are its rows
            theirs.attn.c_proj.weight.copy_(orthogonalized(theirs.attn.c_proj.weight, d))
            theirs.mlp.c_proj.weight.copy_(orthogonalized(theirs.mlp.c_proj.weight, d))
    assert float((ours.blocks[0].attn.W_O @ d).detach().abs().max()) < 1e-6
    assert float((ours(P).detach() - before).abs().max()) > 1e-3
    logits_agree(ours, hf)


def test_an_augmented_assignment_and_a_new_parameter_write_into_the_fused_weights(pair):
    ours, hf = pair
    gen = torch.Generator().manual_seed(1)
    u, v = torch.randn(ours.cfg.d_mlp, generator=gen), torch.randn(ours.cfg.d_model, generator=gen)
    W_Q = torch.randn(ours.blocks[1].attn.W_Q.shape, generator=gen) * 0.1  # [head d_model d_head]
    with torch.no_grad():
        ours.blocks[0].mlp.W_out += 0.5 * torch.outer(u, v)  # ROME's rank-one edit
        ours.blocks[1].attn.W_O = torch.nn.Parameter(torch.zeros_like(ours.blocks[1].attn.W_O))
        ours.blocks[1].attn.W_Q = W_Q
        ours.blocks[0].mlp.W_in.data = ours.blocks[0].mlp.W_in * 2
        hf.transformer.h[0].mlp.c_proj.weight += 0.5 * torch.outer(u, v)
        hf.transformer.h[1].attn.c_proj.weight.zero_()
        d_model = ours.cfg.d_model  # c_attn's columns: q of every head (head-major), then k, then v
        hf.transformer.h[1].attn.c_attn.weight[:, :d_model] = W_Q.permute(1, 0, 2).reshape(d_model, d_model)
        hf.transformer.h[0].mlp.c_fc.weight *= 2
    logits_agree(ours, hf)
    assert "W_O" not in dict(ours.blocks[1].attn.named_parameters())  # no stray parameter registered beside it


def test_views_still_carry_gradients_and_give_plain_tensors(tiny_model):
    attn = tiny_model.blocks[0].attn
    written = torch.einsum("hdm,m->hd", attn.W_O, torch.ones(tiny_model.cfg.d_model))
    assert type(written) is torch.Tensor
    written.sum().backward()
    by_hand = torch.ones_like(attn.out.weight)  # d/d out.weight of the sum of every entry of W_O @ 1
    torch.testing.assert_close(attn.out.weight.grad, by_hand)
    attn.out.weight.grad = None


def test_freezing_a_view_names_the_fused_parameter_to_freeze(tiny_model):
    with pytest.raises(RuntimeError, match=r"attn\.qkv\.weight holds W_Q, W_K and W_V"):
        tiny_model.blocks[0].attn.W_Q.requires_grad_(False)
    assert tiny_model.blocks[0].attn.qkv.weight.requires_grad


def test_a_wrong_shape_is_refused_and_changes_nothing(tiny_model):
    attn = tiny_model.blocks[0].attn
    before = attn.qkv.weight.detach().clone()
    with pytest.raises(ValueError, match=r"W_Q is \(4, 64, 16\) and the new value is \(3,\)"):
        attn.W_Q = torch.zeros(3)
    with pytest.raises(ValueError, match="same shape"):
        attn.W_K.data = torch.zeros(2, 2)
    assert torch.equal(attn.qkv.weight, before)


def test_a_tied_embedding_is_edited_with_its_unembedding_until_untied(pair):
    # transformers and probe hold one matrix for a tied checkpoint; TL's HookedTransformer keeps W_U apart, and
    # abliteration's `model.W_E.data = ...` on it leaves the unembedding: untie_embeddings() gives that
    ours, hf = pair
    assert ours.cfg.tied_embeddings and hf.lm_head.weight is hf.transformer.wte.weight
    d = torch.randn(ours.cfg.d_model, generator=torch.Generator().manual_seed(2))
    d /= d.norm()
    tied = copy.deepcopy(ours)
    tied.W_E.data = orthogonalized(tied.W_E, d)
    with torch.no_grad():
        edited = copy.deepcopy(hf)
        edited.transformer.wte.weight.copy_(orthogonalized(edited.transformer.wte.weight, d))  # the unembedding too
    logits_agree(tied, edited)
    ours.untie_embeddings()
    ours.W_E.data = orthogonalized(ours.W_E, d)
    hf.lm_head.weight = torch.nn.Parameter(hf.transformer.wte.weight.detach().clone())  # TL's separate W_U
    with torch.no_grad():
        hf.transformer.wte.weight.copy_(orthogonalized(hf.transformer.wte.weight, d))
    assert not ours.cfg.tied_embeddings
    logits_agree(ours, hf)


def test_a_weights_grad_by_tl_name_is_hooked_transformers(tmp_path):
    """After `loss.backward()`, TL code reads `model.blocks[0].attn.W_Q.grad`, `mlp.W_out.grad`, `model.W_U.grad`:
    views of probe's fused parameters, whose .grad reads the parameter's gradient through the view. The oracle:
    HookedTransformer (transformer-lens 3.9), the same weights and tokens, its own per-name parameters' .grad."""
    import json

    from safetensors.torch import load_file, save_file

    from probe import HookedDecoder, HookedTransformerConfig
    from test_sae_training import oracle

    settings = dict(n_layers=2, d_model=32, d_head=8, n_heads=4, n_ctx=16, d_vocab=50, d_mlp=64, act_fn="gelu")
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    save_file({"tokens": tokens}, str(tmp_path / "tokens.safetensors"))
    oracle("weight_grads", json.dumps(settings), tmp_path / "tokens.safetensors", tmp_path / "out.safetensors")
    out = load_file(str(tmp_path / "out.safetensors"))
    model = HookedDecoder(HookedTransformerConfig(**settings)).eval()
    model.load_state_dict({k.removeprefix("state."): v for k, v in out.items() if k.startswith("state.")})
    assert model.blocks[0].attn.W_Q.grad is None  # before any backward, as TL's
    model(tokens, return_type="loss").backward()
    named = {"blocks.1.attn.W_Q": model.blocks[1].attn.W_Q, "blocks.1.attn.W_K": model.blocks[1].attn.W_K,
             "blocks.0.attn.W_V": model.blocks[0].attn.W_V, "blocks.0.attn.W_O": model.blocks[0].attn.W_O,
             "blocks.0.attn.b_Q": model.blocks[0].attn.b_Q, "blocks.1.attn.b_O": model.blocks[1].attn.b_O,
             "blocks.0.mlp.W_in": model.blocks[0].mlp.W_in, "blocks.1.mlp.W_out": model.blocks[1].mlp.W_out,
             "blocks.0.mlp.b_in": model.blocks[0].mlp.b_in, "unembed.W_U": model.W_U, "embed.W_E": model.W_E,
             "pos_embed.W_pos": model.W_pos}
    for name, weight in named.items():
        torch.testing.assert_close(weight.grad, out[f"grad.{name}"], atol=1e-5, rtol=1e-4, msg=name)

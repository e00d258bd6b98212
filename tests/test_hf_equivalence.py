"""probe against `transformers`' own forward on the same checkpoint: logits, residual stream, patterns."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder

from conftest import build_hf_checkpoint

CONFIGS = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, n_positions=48),
    "deep-narrow": dict(n_layer=5, n_embd=32, n_head=8, n_positions=40),
    "one-head-relu": dict(n_layer=1, n_embd=48, n_head=1, n_positions=32, activation_function="relu", n_inner=80),
    "exact-gelu-eps": dict(n_layer=3, n_embd=96, n_head=6, n_positions=64, activation_function="gelu", layer_norm_epsilon=1e-6),
}


def load_pair(directory):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(directory, attn_implementation="eager").eval()
    return hf, HookedDecoder.from_pretrained(directory).eval()


def assert_matches_transformers(hf, ours, tokens, atol=1e-4):
    with torch.no_grad():
        expected = hf(tokens, output_hidden_states=True, output_attentions=True)
        logits, cache = ours.run_with_cache(tokens)
    torch.testing.assert_close(logits, expected.logits, atol=atol, rtol=0)
    for layer in range(ours.cfg.n_layers):
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_pre"], expected.hidden_states[layer], atol=atol, rtol=0)
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_pattern"], expected.attentions[layer], atol=atol, rtol=0)
    # transformers' last hidden state is the final norm's output; hook_normalized is before its affine map
    ln_final = ours.ln_final
    final = cache["ln_final.hook_normalized"] * ln_final.w + ln_final.b
    torch.testing.assert_close(final, expected.hidden_states[-1], atol=atol, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(name, tmp_path):
    directory = build_hf_checkpoint(tmp_path, seed=len(name), **CONFIGS[name])
    hf, ours = load_pair(directory)
    n_ctx = ours.cfg.n_ctx
    tokens = torch.randint(0, ours.cfg.d_vocab, (2, n_ctx), generator=torch.Generator().manual_seed(1))
    assert_matches_transformers(hf, ours, tokens)
    # the plain forward (SDPA path, fused LayerNorm) gives the same logits as the cached one
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
    # what we save, transformers loads as the same model: every config field (eps, activation, n_inner) is written
    from transformers import GPT2LMHeadModel

    again = GPT2LMHeadModel.from_pretrained(ours.save_pretrained(tmp_path / "saved")).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_matches_transformers_at_gpt2_small_size(tmp_path):
    directory = build_hf_checkpoint(tmp_path, n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    hf, ours = load_pair(directory)
    tokens = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(2))
    assert_matches_transformers(hf, ours, tokens)


@pytest.mark.slow
def test_matches_transformers_at_pythia_70m_size(tmp_path):
    """Pythia-70m's shape: 6 parallel blocks, d_head 64 of which 16 rotate, an untied 50304-token head."""
    from test_variants import build

    hf = build("neox", tmp_path, vocab_size=50304, hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
               num_attention_heads=8, max_position_embeddings=2048, layer_norm_eps=1e-5,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    assert (ours.cfg.d_head, ours.cfg.rotary_dim) == (64, 16)
    tokens = torch.randint(0, 50304, (2, 96), generator=torch.Generator().manual_seed(2))
    assert_matches_transformers(hf, ours, tokens)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_zeroing_a_head_equals_zeroing_its_output_projection_rows(tiny_dir, tiny_model, tokens):
    """Ablating head h on hook_z == a transformers model whose c_proj input rows for h are zero."""
    from transformers import GPT2LMHeadModel

    layer, head, d_head = 1, 2, tiny_model.cfg.d_head
    hf = GPT2LMHeadModel.from_pretrained(tiny_dir).eval()
    with torch.no_grad():
        hf.transformer.h[layer].attn.c_proj.weight[head * d_head : (head + 1) * d_head, :] = 0.0
        expected = hf(tokens).logits

    def zero_head(z, hook):
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    with torch.no_grad():
        ablated = tiny_model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_head)])
        clean = tiny_model(tokens)
    torch.testing.assert_close(ablated, expected, atol=1e-4, rtol=0)
    assert (ablated - clean).abs().max() > 1e-3  # the ablation did something


def test_text_input_matches_transformers_on_same_token_ids(tiny_model, tiny_hf):
    text = "To be, or not to be, that is the question"
    tokens = tiny_model.to_tokens(text)
    assert tokens[0, 0].item() == tiny_model.tokenizer.bos_id
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(text), tiny_hf(tokens).logits, atol=1e-4, rtol=0)


def test_weight_views_are_transformers_parameters(tiny_model, tiny_hf):
    """W_Q/W_K/W_V/W_O/W_in/W_out/W_U, the per-head views analyses read, sliced by hand from transformers'
    own parameters (Conv1D stores [in, out]; c_attn's columns are q, k, v, each head after head)."""
    dm, dh = tiny_model.cfg.d_model, tiny_model.cfg.d_head
    for ours, theirs in zip(tiny_model.blocks, tiny_hf.transformer.h):
        attn, c_attn, c_proj = ours.attn, theirs.attn.c_attn.weight, theirs.attn.c_proj.weight
        for h in range(tiny_model.cfg.n_heads):
            cols = slice(h * dh, (h + 1) * dh)
            assert torch.equal(attn.W_Q[h], c_attn[:, cols])
            assert torch.equal(attn.W_K[h], c_attn[:, dm:][:, cols])
            assert torch.equal(attn.W_V[h], c_attn[:, 2 * dm:][:, cols])
            assert torch.equal(attn.W_O[h], c_proj[cols])
        assert torch.equal(attn.b_O, theirs.attn.c_proj.bias)
        assert torch.equal(ours.mlp.W_in, theirs.mlp.c_fc.weight) and torch.equal(ours.mlp.W_out, theirs.mlp.c_proj.weight)
    assert torch.equal(tiny_model.unembed.W_U, tiny_hf.lm_head.weight.T)
    assert torch.equal(tiny_model.embed.W_E, tiny_hf.transformer.wte.weight)
    assert torch.equal(tiny_model.pos_embed.W_pos, tiny_hf.transformer.wpe.weight)


def test_model_level_weights_stack_transformers_parameters(tiny_model, tiny_hf):
    """model.W_Q [layer head d_model d_head], model.b_V, ... (transformer-lens's names), sliced by hand
    from transformers' parameters."""
    dm, dh, m = tiny_model.cfg.d_model, tiny_model.cfg.d_head, tiny_model
    for l, theirs in enumerate(tiny_hf.transformer.h):
        c_attn, bias = theirs.attn.c_attn.weight, theirs.attn.c_attn.bias
        for h in range(m.cfg.n_heads):
            cols = slice(h * dh, (h + 1) * dh)
            assert torch.equal(m.W_Q[l, h], c_attn[:, cols]) and torch.equal(m.b_Q[l, h], bias[cols])
            assert torch.equal(m.W_K[l, h], c_attn[:, dm:][:, cols]) and torch.equal(m.b_K[l, h], bias[dm:][cols])
            assert torch.equal(m.W_V[l, h], c_attn[:, 2 * dm:][:, cols]) and torch.equal(m.b_V[l, h], bias[2 * dm:][cols])
            assert torch.equal(m.W_O[l, h], theirs.attn.c_proj.weight[cols])
        assert torch.equal(m.b_O[l], theirs.attn.c_proj.bias)
        assert torch.equal(m.W_in[l], theirs.mlp.c_fc.weight) and torch.equal(m.b_in[l], theirs.mlp.c_fc.bias)
        assert torch.equal(m.W_out[l], theirs.mlp.c_proj.weight) and torch.equal(m.b_out[l], theirs.mlp.c_proj.bias)
    assert torch.equal(m.W_E, tiny_hf.transformer.wte.weight) and torch.equal(m.W_pos, tiny_hf.transformer.wpe.weight)
    # GPT-2 has no unembedding bias: zeros, as transformer-lens's b_U, so `resid @ W_U + b_U` runs
    assert torch.equal(m.W_U, tiny_hf.lm_head.weight.T) and torch.equal(m.b_U, torch.zeros(m.cfg.d_vocab))


def test_model_level_weights_of_grouped_query_attention_keep_one_key_value_head_each(tmp_path):
    """Llama with 8 query heads sharing 2 key/value heads, q/k/v biases and a gated MLP: W_K, W_V,
    b_K, b_V are stacked over key/value heads (transformer-lens repeats them per query head)."""
    from test_variants import build

    hf = build("llama", tmp_path, attention_bias=True)
    m = HookedDecoder.from_pretrained(tmp_path)
    dh, n_layers = m.cfg.d_head, m.cfg.n_layers
    assert m.W_Q.shape == (n_layers, 8, m.cfg.d_model, dh) and m.W_K.shape == m.W_V.shape == (n_layers, 2, m.cfg.d_model, dh)
    assert m.b_Q.shape == (n_layers, 8, dh) and m.b_K.shape == m.b_V.shape == (n_layers, 2, dh)
    for l, layer in enumerate(hf.model.layers):
        attn, rows = layer.self_attn, lambda h: slice(h * dh, (h + 1) * dh)  # nn.Linear weight: [out, in]
        for h in range(8):
            assert torch.equal(m.W_Q[l, h], attn.q_proj.weight[rows(h)].T) and torch.equal(m.b_Q[l, h], attn.q_proj.bias[rows(h)])
            assert torch.equal(m.W_O[l, h], attn.o_proj.weight[:, rows(h)].T)
        for kv in range(2):
            assert torch.equal(m.W_K[l, kv], attn.k_proj.weight[rows(kv)].T) and torch.equal(m.b_K[l, kv], attn.k_proj.bias[rows(kv)])
            assert torch.equal(m.W_V[l, kv], attn.v_proj.weight[rows(kv)].T) and torch.equal(m.b_V[l, kv], attn.v_proj.bias[rows(kv)])
        assert torch.equal(m.b_O[l], attn.o_proj.bias)  # attention_bias covers the output projection too
        assert torch.equal(m.W_in[l], layer.mlp.up_proj.weight.T) and torch.equal(m.W_out[l], layer.mlp.down_proj.weight.T)
    # biases the checkpoint lacks are zeros, at the model level and in the blocks (transformer-lens's)
    assert torch.equal(m.W_U, hf.lm_head.weight.T) and torch.equal(m.b_U, torch.zeros(m.cfg.d_vocab))
    assert torch.equal(m.b_in, torch.zeros(n_layers, m.cfg.d_mlp)) and torch.equal(m.blocks[0].mlp.b_in, torch.zeros(m.cfg.d_mlp))
    assert torch.equal(m.b_out, torch.zeros(n_layers, m.cfg.d_model)) and m.blocks[0].mlp.fc_out.bias is None


def test_model_level_weights_say_when_they_do_not_exist():
    from probe import DecoderConfig, HookedDecoder

    pruned = HookedDecoder(DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, heads_per_layer=(3, 1)))
    with pytest.raises(ValueError, match="structurally pruned"):
        pruned.W_Q
    assert pruned.W_in.shape == (2, 32, 128)  # MLPs are not pruned: they stack
    rotary = HookedDecoder(DecoderConfig(n_layers=1, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, positions="rotary",
                                         qkv_bias=False, out_bias=False, mlp_bias=False))
    with pytest.raises(ValueError, match="rotary"):
        rotary.W_pos
    # a missing bias is zeros of its shape, at the model level and in the block (transformer-lens's: EAP-IG stacks
    # every block's attn.b_O), which no edit reaches: one in place is refused by torch, an assignment by name
    assert torch.equal(rotary.b_Q, torch.zeros(1, 4, 8)) and torch.equal(rotary.b_in, torch.zeros(1, 128))
    attn, mlp = rotary.blocks[0].attn, rotary.blocks[0].mlp
    assert attn.qkv.bias is None and attn.out.bias is None and mlp.fc_in.bias is None
    assert torch.equal(torch.stack([block.attn.b_O for block in rotary.blocks]), torch.zeros(1, 32))
    for bias, shape in ((attn.b_Q, (4, 8)), (attn.b_K, (4, 8)), (attn.b_V, (4, 8)), (attn.b_O, (32,)),
                        (mlp.b_in, (128,)), (mlp.b_out, (32,))):
        assert torch.equal(bias, torch.zeros(shape))
        with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
            bias.add_(1.0)
    with pytest.raises(ValueError, match="this model has no b_O"):
        attn.b_O = torch.ones(32)

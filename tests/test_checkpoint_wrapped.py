"""probe/checkpoint_wrapped.py: LLaVA, LLaVA-NeXT, LLaVA-OneVision, Idefics3, Emu3 and the audio models' (Qwen2-Audio,
Audio Flamingo 3, Music Flamingo, GLM-ASR) files read for their language model,
whatever family text_config names: on token ids the logits and every residual are transformers' multimodal model's,
the model saves as the text-only format (transformers' XForCausalLM reads it back to the same logits), tied heads
follow each wrapper's own rule, and TL 4's bridge agrees hook by hook."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import HookedDecoder
from probe.config_file import CheckpointError
from test_variants import perturbed

TOKENS = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(5))  # (below every image token id)
SHAPE = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# each language model with what makes it itself: Mistral's window, Qwen2's biases, Granite's four multipliers (its
# logits divisor, and Cohere's logit scale, are its text-only head's, which the wrapper's head does not apply), Falcon's
# fused q/k/v and LayerNorms
TEXTS = {
    "llama": dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "mistral": dict(sliding_window=4),
    "qwen2": dict(tie_word_embeddings=True),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=4.0, attention_multiplier=0.3),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True, bias=False),
    "cohere": dict(logit_scale=0.25),
}
TEXT_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "granite": "GraniteForCausalLM", "falcon": "FalconForCausalLM", "cohere": "CohereForCausalLM"}


VQ = dict(codebook_size=16, embed_dim=32, latent_channels=32, base_channels=32, channel_multiplier=[1], num_res_blocks=1,
          attn_resolutions=[], double_latent=False, temporal_downsample_factor=1)


WHISPER_LIKE = dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16, d_model=16,
                    max_source_positions=16)
AUDIO = {"qwen2_audio": dict(WHISPER_LIKE, model_type="qwen2_audio_encoder"),
         "audioflamingo3": dict(WHISPER_LIKE, model_type="audioflamingo3_encoder"),
         "musicflamingo": dict(WHISPER_LIKE, model_type="audioflamingo3_encoder"),
         "glmasr": dict(model_type="glmasr_encoder", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_mel_bins=8)}


def vision(kind):
    if kind == "idefics3":
        return dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                    patch_size=8)
    tower = "siglip_vision_model" if kind == "llava_onevision" else "clip_vision_model"
    return dict(model_type=tower, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                image_size=32, patch_size=8, **({} if kind == "llava_onevision" else {"projection_dim": 16}))


def build_wrapped(kind, text_type, directory, vocab=101, text=None, **top):
    """A random multimodal `kind` checkpoint whose language model is `text_type`, norms and biases away from their
    defaults, saved by transformers (the released layout: `language_model.model.*`, `model.text_model.*`)."""
    import transformers as tf

    classes = {"llava": (tf.LlavaForConditionalGeneration, tf.LlavaConfig),
               "llava_next": (tf.LlavaNextForConditionalGeneration, tf.LlavaNextConfig),
               "llava_onevision": (tf.LlavaOnevisionForConditionalGeneration, tf.LlavaOnevisionConfig),
               "idefics3": (tf.Idefics3ForConditionalGeneration, tf.Idefics3Config),
               "emu3": (tf.Emu3ForConditionalGeneration, tf.Emu3Config),
               "qwen2_audio": (tf.Qwen2AudioForConditionalGeneration, tf.Qwen2AudioConfig),
               "audioflamingo3": (tf.AudioFlamingo3ForConditionalGeneration, tf.AudioFlamingo3Config),
               "musicflamingo": (tf.MusicFlamingoForConditionalGeneration, tf.MusicFlamingoConfig),
               "glmasr": (tf.GlmAsrForConditionalGeneration, tf.GlmAsrConfig)}
    model_class, config_class = classes[kind]
    text = {**SHAPE, "vocab_size": vocab, "model_type": text_type, **TEXTS[text_type], **(text or {})}
    if kind == "emu3":  # (its text model is Llama's under a model_type of its own; its VQ-VAE in place of a tower)
        text.update(model_type="emu3_text_model", pad_token_id=0, bos_token_id=1, eos_token_id=2)
        parts = dict(vq_config=VQ, vocabulary_map={"<image>": 100})
    elif kind in AUDIO:
        parts = dict(audio_config=AUDIO[kind])
    else:
        parts = dict(vision_config=vision(kind))
    torch.manual_seed(0)
    hf = perturbed(model_class(config_class(text_config=text, **parts, **top)))
    hf.save_pretrained(directory)
    return model_class.from_pretrained(directory, attn_implementation="eager").eval()


CASES = [("llava", "llama"), ("llava", "mistral"), ("llava_next", "granite"), ("llava_next", "falcon"),
         ("llava_onevision", "qwen2"), ("idefics3", "llama"), ("llava", "cohere"), ("emu3", "llama"),
         ("qwen2_audio", "qwen2"), ("audioflamingo3", "qwen2"), ("musicflamingo", "qwen2"), ("glmasr", "llama")]


@pytest.mark.parametrize("kind, text_type", CASES)
def test_the_language_model_is_the_wrappers_on_text_and_saves_as_the_text_format(kind, text_type, tmp_path):
    import transformers as tf

    hf = build_wrapped(kind, text_type, tmp_path / "multimodal")
    model = HookedDecoder.from_pretrained(tmp_path / "multimodal").eval()
    assert model.cfg.original_architecture == TEXT_CLASSES[text_type]
    with torch.no_grad():
        expected = hf(input_ids=TOKENS, output_hidden_states=True)
        logits, cache = model.run_with_cache(TOKENS)
        torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=0)
        for layer in range(2):
            torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_pre"], expected.hidden_states[layer],
                                       atol=1e-4, rtol=0)
        saved = model.save_pretrained(tmp_path / "text")
        assert json.loads((saved / "config.json").read_text())["architectures"] == [TEXT_CLASSES[text_type]]
        again = getattr(tf, TEXT_CLASSES[text_type]).from_pretrained(saved).eval()
        torch.testing.assert_close(again(TOKENS).logits, expected.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind, tied", [("llava", True), ("llava_onevision", True), ("llava_next", False),
                                        ("idefics3", False), ("emu3", False), ("qwen2_audio", False)])
def test_a_head_tied_in_text_config_alone_ties_as_the_wrapper_says(kind, tied, tmp_path):
    """LLaVA's and LLaVA-OneVision's configs copy text_config's tie_word_embeddings up; LLaVA-NeXT, Idefics3 and Emu3
    follow their top-level field (false here), so their files hold a head of its own; Qwen2-Audio's never ties."""
    text_type = "qwen2" if kind in ("llava_onevision", "qwen2_audio") else "llama"
    import transformers as tf

    classes = {"llava": tf.LlavaForConditionalGeneration, "llava_next": tf.LlavaNextForConditionalGeneration,
               "llava_onevision": tf.LlavaOnevisionForConditionalGeneration,
               "idefics3": tf.Idefics3ForConditionalGeneration, "emu3": tf.Emu3ForConditionalGeneration,
               "qwen2_audio": tf.Qwen2AudioForConditionalGeneration}
    build_wrapped(kind, text_type, tmp_path, text={"tie_word_embeddings": False},
                  **({} if kind in AUDIO else {"tie_word_embeddings": False}))
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    assert config.get("tie_word_embeddings", False) is False
    config["text_config"]["tie_word_embeddings"] = True
    if kind in AUDIO:  # (a field its config class does not have, which transformers ignores)
        config["tie_word_embeddings"] = True
    if tied:  # a released tied file holds no separate head
        state = load_file(tmp_path / "model.safetensors")
        save_file({k: v for k, v in state.items() if "lm_head" not in k}, tmp_path / "model.safetensors",
                  metadata={"format": "pt"})
    path.write_text(json.dumps(config))
    hf = classes[kind].from_pretrained(tmp_path).eval()
    assert (hf.lm_head.weight is hf.get_input_embeddings().weight) == tied  # (the oracle's own reading)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert model.cfg.tied_embeddings == tied
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(input_ids=TOKENS).logits, atol=1e-4, rtol=0)


def test_an_older_file_keeping_the_language_models_own_prefix_reads_the_same(tmp_path):
    """transformers 4 saved a LLaVA's language model whole, so Falcon's tensors sit under `language_model.transformer.`
    (falcon-11B-vlm); transformers 5 writes `language_model.model.`: both read to the same model."""
    hf = build_wrapped("llava_next", "falcon", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    older = {k.replace("language_model.model.", "language_model.transformer."): v for k, v in state.items()}
    assert any(k.startswith("language_model.transformer.h.") for k in older)
    save_file(older, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        torch.testing.assert_close(HookedDecoder.from_pretrained(tmp_path)(TOKENS), hf(input_ids=TOKENS).logits,
                                   atol=1e-4, rtol=0)


def test_a_float32_vision_tower_leaves_a_bfloat16_language_model_bfloat16(tmp_path):
    build_wrapped("llava", "llama", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    mixed = {k: v.to(torch.bfloat16) if k.startswith("language_model.") else v for k, v in state.items()}
    save_file(mixed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert HookedDecoder.from_pretrained(tmp_path).W_E.dtype == torch.bfloat16


@pytest.mark.parametrize("text_type, why", [("t5", "'t5' is not a language model probe reads"),
                                            ("gemma3", "'gemma3' is not a language model probe reads"),
                                            ("llava", "'llava' is not a language model probe reads")])
def test_a_text_config_probe_cannot_read_is_refused_by_name(text_type, why, tmp_path):
    """(a multimodal family's own file, or another wrapper, is not a language model to read inside one)"""
    build_wrapped("llava", "llama", tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["text_config"]["model_type"] = text_type
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"text_config.model_type={why} inside LLaVA checkpoints; "
                                              "supported: gpt2, openai-gpt, llama"):
        HookedDecoder.from_pretrained(tmp_path)


@pytest.mark.parametrize("kind, text_type", [("llava", "llama"), ("llava_onevision", "qwen2"), ("emu3", "llama"),
                                             ("qwen2_audio", "qwen2"), ("audioflamingo3", "qwen2"),
                                             ("musicflamingo", "qwen2"), ("glmasr", "llama")])
def test_hooks_match_the_bridge(kind, text_type, tmp_path):
    """TL 4's LLaVA, Emu3 and audio adapters run the language model with Llama's components; on these the bridge
    and probe agree at every hook both have."""
    from probe.tokenizer import Tokenizer
    from test_family_defaults import LLAMA_FILES, QWEN_FILES, tokenizer_dir
    from test_transformer_lens import compare_with_transformer_lens

    files = QWEN_FILES if text_type == "qwen2" else LLAMA_FILES
    directory = tokenizer_dir(tmp_path / "checkpoint", *files)
    build_wrapped(kind, text_type, directory, vocab=len(Tokenizer.from_directory(directory)))
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4)
    assert {"blocks.1.attn.hook_pattern", "blocks.1.hook_mlp_out", "blocks.1.hook_resid_post"} <= theirs
    assert not {n for n in missing if n.startswith("blocks.1.") and ".attn." not in n}, missing


@pytest.mark.parametrize("kind, text_type", [("llava", "llama"), ("llava_onevision", "qwen2")])
def test_text_gets_bos_as_the_language_models_own_family_gives_it(kind, text_type, tmp_path):
    """A Qwen2 language model is trained without BOS, a Llama one with it, inside a LLaVA file as alone (the text-only
    families' defaults are checked against transformer-lens's in test_family_defaults). TL 4's LLaVA adapters prepend
    one to every text instead (a Qwen2 tokenizer has none: they put <|endoftext|> first)."""
    from probe.checkpoints import FAMILIES
    from probe.tokenizer import Tokenizer
    from test_family_defaults import LLAMA_FILES, QWEN_FILES, tokenizer_dir

    directory = tokenizer_dir(tmp_path / "checkpoint", *(QWEN_FILES if text_type == "qwen2" else LLAMA_FILES))
    build_wrapped(kind, text_type, directory, vocab=len(Tokenizer.from_directory(directory)))
    model = HookedDecoder.from_pretrained(directory)
    assert model.cfg.default_prepend_bos == FAMILIES[text_type].prepends_bos == (text_type == "llama")
    plain = model.tokenizer.encode("hello there", add_special_tokens=False)
    assert model.to_tokens("hello there")[0].tolist() == [model.tokenizer.bos_id] * (text_type == "llama") + plain


@pytest.mark.parametrize("kind, text_type", [("llava_onevision", "qwen2"), ("idefics3", "llama")])
def test_a_text_config_naming_no_model_type_is_the_wrappers_default_language_model(kind, text_type, tmp_path):
    """(the oracle: transformers' own reading of the same file)"""
    import transformers as tf

    build_wrapped(kind, text_type, tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    del config["text_config"]["model_type"]
    path.write_text(json.dumps(config))
    assert tf.AutoConfig.from_pretrained(tmp_path).text_config.model_type == text_type
    assert HookedDecoder.from_pretrained(tmp_path).cfg.original_architecture == TEXT_CLASSES[text_type]


def test_a_glm_asr_config_without_the_tie_field_ties_as_transformers_does(tmp_path):
    import transformers as tf

    build_wrapped("glmasr", "llama", tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    del config["tie_word_embeddings"]
    path.write_text(json.dumps(config))
    hf = tf.GlmAsrForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert hf.lm_head.weight is hf.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(HookedDecoder.from_pretrained(tmp_path)(TOKENS), hf(input_ids=TOKENS).logits,
                                   atol=1e-4, rtol=0)


def test_compatibility_mode_is_the_bridges(tmp_path):
    """TL 4's LLaVA adapter folds the norms in compatibility mode, as probe does: logits and activations agree."""
    from transformer_lens.model_bridge import TransformerBridge

    from probe.tokenizer import Tokenizer
    from test_family_defaults import LLAMA_FILES, tokenizer_dir

    directory = tokenizer_dir(tmp_path / "checkpoint", *LLAMA_FILES)
    build_wrapped("llava", "llama", directory, vocab=len(Tokenizer.from_directory(directory)))
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory))
    model.enable_compatibility_mode()
    bridge.enable_compatibility_mode()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        ours, cache = model.run_with_cache(tokens)
        theirs, their_cache = bridge.run_with_cache(tokens)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_normalized", "blocks.1.attn.hook_z", "blocks.1.hook_mlp_out",
                 "blocks.1.hook_resid_post"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)

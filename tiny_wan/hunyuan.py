"""Build a tiny HunyuanVideo in code, deterministically and offline.

Every component is the class a HunyuanVideo checkpoint (hunyuanvideo-community/HunyuanVideo)
loads into, so the tiny model runs the code path of the real one through diffusers'
`HunyuanVideoPipeline`:

- `transformer`: `HunyuanVideoTransformer3DModel` (dual-stream then single-stream blocks, a
  token refiner over the Llama states, embedded guidance: HunyuanVideo is guidance-distilled);
- `vae`: `AutoencoderKLHunyuanVideo` with the real strides (8x spatially, 4x in time);
- `scheduler`: `FlowMatchEulerDiscreteScheduler(shift=7.0)`, HunyuanVideo's flow shift;
- `text_encoder` / `tokenizer`: a tiny `LlamaModel` and a word-level tokenizer that knows
  Llama 3's chat-header special tokens and every word of diffusers' prompt template;
- `text_encoder_2` / `tokenizer_2`: a tiny `CLIPTextModel` (its pooled output conditions the
  time embedding) and a word-level tokenizer with CLIP's special tokens.

`HunyuanVideoPipeline(**build_tiny_hunyuan(cfg))(prompt, prompt_template=prompt_template(...))`

The prompt template. diffusers' `_get_llama_prompt_embeds` formats the prompt into
`DEFAULT_PROMPT_TEMPLATE["template"]` (a system message and a user header around the prompt),
runs Llama, keeps the hidden states `num_hidden_layers_to_skip + 1 = 3` from the end (the
pipeline's default, not a `__call__` argument) and drops the first `crop_start` tokens (the
template's prefix). The default dict hard-codes `crop_start=95`, the prefix length under the
real Llama-3 BPE tokenizer. The tiny word-level tokenizer splits the prefix into
`crop_start(tokenizer)` tokens (94: BOS, the header tokens, "\\n\\n", words, punctuation), so a
caller of the tiny model must pass `prompt_template=prompt_template(tokenizer)` (the same
template text with the crop the pipeline itself computes when "crop_start" is absent);
with the default dict the pipeline would also drop the prompt's first token. Real checkpoints
need no template argument.

The saved tokenizers are `PreTrainedTokenizerFast` (model_index.json says so), not the
`LlamaTokenizerFast` / `CLIPTokenizer` of the real checkpoints; the pipeline only calls them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoTransformer3DModel,
)
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel, PreTrainedTokenizerFast

from tiny_wan.build import VOCAB_WORDS

# diffusers' template (this diffusers version): "<|start_header_id|>system<|end_header_id|>\n\n
# Describe the video by ...:<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>".
TEMPLATE: str = DEFAULT_PROMPT_TEMPLATE["template"]
# The crop the default dict hard-codes (the real tokenizer's prefix length).
DEFAULT_CROP_START: int = DEFAULT_PROMPT_TEMPLATE["crop_start"]
# `_get_llama_prompt_embeds(num_hidden_layers_to_skip=2)`: hidden_states[-3] is used.
LLAMA_LAYERS_TO_SKIP = 2
# `encode_prompt` calls `_get_clip_prompt_embeds(max_sequence_length=77)`: CLIP's context.
CLIP_MAX_LENGTH = 77
# HunyuanVideo's flow shift (its scheduler_config.json and the original `--flow-shift 7.0`).
FLOW_SHIFT = 7.0

# Llama 3's special tokens as the template uses them (the real ids differ: 128000...).
LLAMA_BOS = "<|begin_of_text|>"
LLAMA_EOS = "<|end_of_text|>"
LLAMA_SPECIALS = ("<pad>", "<unk>", LLAMA_BOS, LLAMA_EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
# CLIP's: <|startoftext|> ... <|endoftext|>, padded with <|endoftext|> (as openai/clip-vit-large-patch14).
CLIP_BOS = "<|startoftext|>"
CLIP_EOS = "<|endoftext|>"
CLIP_SPECIALS = (CLIP_BOS, CLIP_EOS, "<unk>")

# Newline runs are tokens (Llama 3 has "\n\n"); then words and punctuation runs, spaces dropped.
_PRE_TOKENIZER = pre_tokenizers.Sequence(
    [
        pre_tokenizers.Split(Regex(r"[\r\n]+"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"[^\S\r\n]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+"), behavior="isolated"),
    ]
)


def template_words(template: str = TEMPLATE) -> tuple[str, ...]:
    """The template's words and punctuation in order of appearance (lower case, no specials)."""
    text = template.replace("{}", " ")
    for special in LLAMA_SPECIALS:
        text = text.replace(special, " ")
    words: dict[str, None] = {}
    for piece, _ in _PRE_TOKENIZER.pre_tokenize_str(text.lower()):
        words.setdefault(piece, None)
    return tuple(words)


@dataclass(frozen=True)
class TinyHunyuanConfig:
    """Sizes of the tiny HunyuanVideo. Changing any number changes the weights."""

    seed: int = 0
    # transformer: inner dim heads * head_dim; rope_axes_dim (T, H, W) must sum to head_dim
    # (real: 24 x 128, (16, 56, 56)). Unequal H and W dims here make an H/W mix-up visible;
    # 4 heads allow Ulysses 2 and 4.
    heads: int = 4
    head_dim: int = 12
    rope_axes_dim: tuple[int, int, int] = (2, 4, 6)
    rope_theta: float = 256.0
    layers: int = 2  # dual-stream blocks (real: 20)
    single_layers: int = 2  # single-stream blocks (real: 40)
    refiner_layers: int = 2  # token refiner blocks over the Llama states (real: 2)
    mlp_ratio: float = 4.0
    patch_size: int = 2  # spatial (real: 2)
    patch_size_t: int = 1  # temporal (real: 1)
    # VAE: 4 blocks give the real 8x spatial and 4x temporal compression.
    latent_channels: int = 4  # real: 16
    vae_channels: tuple[int, int, int, int] = (8, 8, 8, 8)
    vae_groups: int = 4
    scaling_factor: float = 0.476986  # HunyuanVideo's
    # Llama text encoder (real: llava-llama-3-8b, 4096 wide, 32 layers, 32 heads / 8 kv heads)
    llama_dim: int = 32
    llama_layers: int = 3  # > LLAMA_LAYERS_TO_SKIP, so hidden_states[-3] is a layer's output
    llama_heads: int = 4
    llama_kv_heads: int = 2
    llama_ffn: int = 64
    llama_positions: int = 512  # >= crop_start + max_sequence_length (256)
    # CLIP text encoder (real: clip-vit-large-patch14, 768 wide); its pooled output -> temb
    clip_dim: int = 24
    clip_layers: int = 2
    clip_heads: int = 2
    flow_shift: float = FLOW_SHIFT
    vocab: tuple[str, ...] = field(default=VOCAB_WORDS)

    def __post_init__(self) -> None:
        if sum(self.rope_axes_dim) != self.head_dim or any(d % 2 for d in self.rope_axes_dim):
            raise ValueError(f"rope_axes_dim {self.rope_axes_dim} must be even and sum to head_dim {self.head_dim}")
        if self.llama_layers <= LLAMA_LAYERS_TO_SKIP:
            raise ValueError(f"llama_layers must exceed {LLAMA_LAYERS_TO_SKIP}: the pipeline reads hidden_states[-3]")
        if self.llama_dim % self.llama_heads or self.llama_heads % self.llama_kv_heads:
            raise ValueError("llama_dim must divide into llama_heads, and llama_heads into llama_kv_heads")
        if self.clip_dim % self.clip_heads:
            raise ValueError("clip_dim must divide into clip_heads")
        if len(self.vae_channels) != 4:
            raise ValueError("the HunyuanVideo VAE needs 4 blocks for 8x spatial, 4x temporal compression")

    @property
    def inner_dim(self) -> int:
        return self.heads * self.head_dim


TINY_HUNYUAN = TinyHunyuanConfig()


def _word_level(specials: tuple[str, ...], words: tuple[str, ...]) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(specials)}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = _PRE_TOKENIZER
    tok.add_special_tokens(list(specials))  # matched before normalization, never split
    return tok


def build_llama_tokenizer(words: tuple[str, ...] = VOCAB_WORDS) -> PreTrainedTokenizerFast:
    """Llama-3-like: BOS only (no EOS appended, so the template ends in "{}", "<|eot_id|>" as
    the pipeline's crop rule assumes), right padding with <pad>, no model_max_length (the
    pipeline's crop computation pads the template to "max_length" without a length: with a
    finite model_max_length it would pad to it and get the crop wrong)."""
    tok = _word_level(LLAMA_SPECIALS, (*template_words(), *words))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA_BOS} $A", special_tokens=[(LLAMA_BOS, tok.token_to_id(LLAMA_BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=LLAMA_BOS, eos_token=LLAMA_EOS, pad_token="<pad>", unk_token="<unk>"
    )


def build_clip_tokenizer(words: tuple[str, ...] = VOCAB_WORDS) -> PreTrainedTokenizerFast:
    """CLIP-like: <|startoftext|> $A <|endoftext|>, padded with <|endoftext|>, 77 tokens."""
    tok = _word_level(CLIP_SPECIALS, words)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLIP_BOS} $A {CLIP_EOS}",
        special_tokens=[(CLIP_BOS, tok.token_to_id(CLIP_BOS)), (CLIP_EOS, tok.token_to_id(CLIP_EOS))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=CLIP_BOS,
        eos_token=CLIP_EOS,
        pad_token=CLIP_EOS,
        unk_token="<unk>",
        model_max_length=CLIP_MAX_LENGTH,
    )


def crop_start(tokenizer, template: str = TEMPLATE) -> int:
    """The template prefix's token count, by the pipeline's own rule (`_get_llama_prompt_embeds`
    with no "crop_start"): tokens of the template minus the placeholder and the final <|eot_id|>."""
    return len(tokenizer(template)["input_ids"]) - 2


def prompt_template(tokenizer, template: str = TEMPLATE) -> dict:
    """The `prompt_template` argument of `HunyuanVideoPipeline.__call__` for a tokenizer:
    diffusers' template with this tokenizer's crop (pass it for the tiny model)."""
    return {"template": template, "crop_start": crop_start(tokenizer, template)}


def build_tiny_hunyuan(cfg: TinyHunyuanConfig = TINY_HUNYUAN) -> dict:
    """The components of `HunyuanVideoPipeline`: {text_encoder, tokenizer, transformer, vae,
    scheduler, text_encoder_2, tokenizer_2}, every module in eval mode without gradients."""
    tokenizer = build_llama_tokenizer(cfg.vocab)
    tokenizer_2 = build_clip_tokenizer(cfg.vocab)
    # One generator state per component so changing one never changes another's weights.
    torch.manual_seed(cfg.seed)
    text_encoder = LlamaModel(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=cfg.llama_dim,
            intermediate_size=cfg.llama_ffn,
            num_hidden_layers=cfg.llama_layers,
            num_attention_heads=cfg.llama_heads,
            num_key_value_heads=cfg.llama_kv_heads,
            max_position_embeddings=cfg.llama_positions,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    torch.manual_seed(cfg.seed + 1)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        num_attention_heads=cfg.heads,
        attention_head_dim=cfg.head_dim,
        num_layers=cfg.layers,
        num_single_layers=cfg.single_layers,
        num_refiner_layers=cfg.refiner_layers,
        mlp_ratio=cfg.mlp_ratio,
        patch_size=cfg.patch_size,
        patch_size_t=cfg.patch_size_t,
        qk_norm="rms_norm",
        guidance_embeds=True,
        text_embed_dim=cfg.llama_dim,
        pooled_projection_dim=cfg.clip_dim,  # CLIPTextModel's pooler_output is hidden-wide
        rope_theta=cfg.rope_theta,
        rope_axes_dim=cfg.rope_axes_dim,
    )
    torch.manual_seed(cfg.seed + 2)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=cfg.latent_channels,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=cfg.vae_channels,
        layers_per_block=1,
        norm_num_groups=cfg.vae_groups,
        scaling_factor=cfg.scaling_factor,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )
    torch.manual_seed(cfg.seed + 3)
    text_encoder_2 = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer_2),
            hidden_size=cfg.clip_dim,
            intermediate_size=2 * cfg.clip_dim,
            projection_dim=cfg.clip_dim,
            num_hidden_layers=cfg.clip_layers,
            num_attention_heads=cfg.clip_heads,
            max_position_embeddings=CLIP_MAX_LENGTH,
            # Not 2 (transformers' legacy argmax pooling): pool at the first <|endoftext|>.
            bos_token_id=tokenizer_2.bos_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
            pad_token_id=tokenizer_2.pad_token_id,
        )
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=cfg.flow_shift)
    components = {
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
        "vae": vae,
        "scheduler": scheduler,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
    }
    for module in components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    return components

"""Build a tiny HunyuanVideo-1.5 in code, deterministically and offline.

Every component is the class a diffusers-format HunyuanVideo-1.5 checkpoint (hunyuanvideo-community's
480p text-to-video and image-to-video) loads into, so the tiny model runs the code path of the real one
through diffusers' `HunyuanVideo15Pipeline` and `HunyuanVideo15ImageToVideoPipeline`:

- `transformer`: `HunyuanVideo15Transformer3DModel` (dual-stream blocks over the video tokens and one
  joint context of SigLIP image tokens, ByT5 glyph tokens and Qwen tokens; 1x1 patches, as the real one:
  the VAE already compresses 16x). diffusers fixes the ByT5 projection's hidden width at 2048, so that
  projection holds most of the tiny transformer's 4.6M weights;
- `vae`: `AutoencoderKLHunyuanVideo15` with the real strides (16x spatially, 4x in time);
- `scheduler`: `FlowMatchEulerDiscreteScheduler(shift=5.0)` and `guider`:
  `ClassifierFreeGuidance(guidance_scale=6.0)`, the 480p checkpoints' values (diffusers'
  scripts/convert_hunyuan_video1_5_to_diffusers.py, SCHEDULER_CONFIGS and GUIDANCE_CONFIGS for
  "480p_t2v" and "480p_i2v"; 720p uses other shifts, the distilled ones guidance 1.0);
- `text_encoder` / `tokenizer`: a tiny `Qwen2_5_VLTextModel` and a word-level tokenizer with a
  Qwen2-style chat template (see below);
- `text_encoder_2` / `tokenizer_2`: a tiny `T5EncoderModel` and `ByT5Tokenizer` (bytes, no vocabulary
  file). The pipeline runs them only on the quoted text of a prompt ('a sign that says "hello"' encodes
  'Text "hello". '); without quotes it passes zeros and an all-zero mask;
- image-to-video adds `image_encoder` / `feature_extractor`: a tiny `SiglipVisionModel` whose
  27 x 27 patches give the 729 tokens of the real SigLIP-so400m (`vision_num_semantic_tokens`), and
  its image processor. Text-to-video passes 729 zero image tokens, which the transformer masks out.

The prompt template. `_get_mllm_prompt_embeds` formats the prompt as a chat (the pipeline's
`system_message`, then the prompt as the user's turn), runs Qwen over `tokenizer_max_length + 108`
tokens, keeps `hidden_states[-3]` and drops the first `prompt_template_encode_start_idx = 108`
tokens, hard-coded: the real Qwen2.5-VL tokenizer's length of everything before the prompt. The tiny
tokenizer splits text with Qwen2's own pre-tokenization regex and maps every piece to one word-level
token. The template's pieces are common English words (with their leading space), punctuation, digits,
newlines and the space runs the system message's line continuations leave: 108 with the chat tokens,
the pipeline's number (`template_prefix_length`), so the hard-coded crop starts at the prompt's first
token and the tiny model needs no override. Unknown words map to <unk>.

The saved tokenizer is transformers' generic fast tokenizer (`PreTrainedTokenizerFast`, named
`TokenizersBackend` in model_index.json under transformers 5), not a `Qwen2Tokenizer`: the pipeline
only calls `apply_chat_template` on it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
from transformers import (
    ByT5Tokenizer,
    PreTrainedTokenizerFast,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    T5Config,
    T5EncoderModel,
)

from tiny_wan.build import VOCAB_WORDS

_MLLM_DEFAULTS = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
# The pipeline's system message (its __init__ sets the same text; the backslash continuations
# leave runs of spaces in it) and its hard-coded crop, the real tokenizer's prefix length.
SYSTEM_MESSAGE: str = _MLLM_DEFAULTS["system_message"].default
CROP_START: int = _MLLM_DEFAULTS["crop_start"].default  # 108
# `_get_mllm_prompt_embeds(num_hidden_layers_to_skip=2)`: hidden_states[-3] is used.
QWEN_LAYERS_TO_SKIP = _MLLM_DEFAULTS["num_hidden_layers_to_skip"].default
# The 480p checkpoints' flow shift and CFG scale (see the module docstring for the source).
FLOW_SHIFT = 5.0
GUIDANCE_SCALE = 6.0

# Qwen2's special tokens: <|endoftext|> pads, <|im_end|> ends a turn; <unk> is the word-level model's.
QWEN_PAD = "<|endoftext|>"
QWEN_SPECIALS = (QWEN_PAD, "<unk>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenization regex (its tokenizer.json): words with one leading space or
# punctuation mark, single digits, punctuation runs, newline runs, space runs.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER = pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated")
# Qwen2.5-VL's chat template for text-only messages (string contents, no tools): a default system
# turn when the chat has none, each turn as <|im_start|>role\ncontent<|im_end|>\n, then the assistant
# header. transformers renders it with trim_blocks, as the real template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyHunyuan15Config:
    """Sizes of the tiny HunyuanVideo-1.5. Changing any number changes the weights."""

    seed: int = 0
    # transformer: inner dim heads * head_dim; rope_axes_dim (T, H, W) must sum to head_dim
    # (real: 16 x 128, (16, 56, 56)). Unequal H and W dims here make an H/W mix-up visible;
    # 4 heads allow Ulysses 2 and 4.
    heads: int = 4
    head_dim: int = 12
    rope_axes_dim: tuple[int, int, int] = (2, 4, 6)
    rope_theta: float = 256.0
    layers: int = 2  # dual-stream blocks (real: 54)
    refiner_layers: int = 2  # token refiner blocks over the Qwen states (real: 2)
    mlp_ratio: float = 4.0
    # The image-to-video pipeline picks its output size from buckets of about (target_size / 16)^2
    # latent pixels (real: 640 for 480p). 40 gives 6: a 3:2 landscape image makes a 32 x 48 video.
    target_size: int = 40
    # VAE: 5 blocks give the real 16x spatial (4 downsamples) and 4x temporal compression.
    latent_channels: int = 4  # real: 32
    vae_channels: tuple[int, ...] = (8, 16, 16, 32, 32)  # real: (128, 256, 512, 1024, 1024)
    vae_layers: int = 1  # resnets per encoder block (real: 2)
    scaling_factor: float = 1.03682  # HunyuanVideo-1.5's
    # Qwen2.5-VL text model (real: Qwen2.5-VL-7B-Instruct, 3584 wide, 28 layers, 28 heads / 4 kv heads,
    # mrope_section (16, 24, 24): sums to head_dim / 2)
    qwen_dim: int = 32
    qwen_layers: int = 3  # > QWEN_LAYERS_TO_SKIP, so hidden_states[-3] is a layer's output
    qwen_heads: int = 2
    qwen_kv_heads: int = 1
    qwen_ffn: int = 64
    mrope_section: tuple[int, int, int] = (2, 3, 3)
    # ByT5 encoder (real: Glyph-SDXL-v2's byt5-small, 1472 wide, 12 layers, 6 heads of 64)
    t5_dim: int = 16
    t5_layers: int = 2
    t5_heads: int = 2
    t5_head_dim: int = 8
    t5_ffn: int = 32
    # SigLIP vision encoder (real: siglip-so400m-patch14-384, 1152 wide: 384 / 14 = 27 patches a side)
    siglip_dim: int = 16
    siglip_layers: int = 2
    siglip_heads: int = 2
    siglip_image_size: int = 54
    siglip_patch: int = 2
    flow_shift: float = FLOW_SHIFT
    guidance_scale: float = GUIDANCE_SCALE
    vocab: tuple[str, ...] = field(default=VOCAB_WORDS)

    def __post_init__(self) -> None:
        if sum(self.rope_axes_dim) != self.head_dim or any(d % 2 for d in self.rope_axes_dim):
            raise ValueError(f"rope_axes_dim {self.rope_axes_dim} must be even and sum to head_dim {self.head_dim}")
        if self.qwen_layers <= QWEN_LAYERS_TO_SKIP:
            raise ValueError(f"qwen_layers must exceed {QWEN_LAYERS_TO_SKIP}: the pipeline reads hidden_states[-3]")
        if self.qwen_dim % self.qwen_heads or self.qwen_heads % self.qwen_kv_heads:
            raise ValueError("qwen_dim must divide into qwen_heads, and qwen_heads into qwen_kv_heads")
        if 2 * sum(self.mrope_section) != self.qwen_dim // self.qwen_heads:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to half of Qwen's head dim")
        if len(self.vae_channels) != 5:
            raise ValueError("the HunyuanVideo-1.5 VAE needs 5 blocks for 16x spatial, 4x temporal compression")
        if self.vae_channels[-1] % (2 * self.latent_channels):
            raise ValueError("the VAE's last width must be a multiple of 2 * latent_channels (its shortcuts average)")
        if self.siglip_image_size % self.siglip_patch:
            raise ValueError("siglip_image_size must be a multiple of siglip_patch")

    @property
    def inner_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def image_tokens(self) -> int:
        """SigLIP's tokens per image (the pipelines' vision_num_semantic_tokens is 729)."""
        return (self.siglip_image_size // self.siglip_patch) ** 2


TINY_HUNYUAN15 = TinyHunyuan15Config()


def _template_pieces() -> tuple[str, ...]:
    """The pre-tokenized pieces of the chat template around a prompt, lower case, in order."""
    texts = ("system\n" + SYSTEM_MESSAGE, "\n", "user\n", "assistant\n", "system\nYou are a helpful assistant.")
    return tuple(piece for text in texts for piece, _ in _PRE_TOKENIZER.pre_tokenize_str(text.lower()))


def build_qwen_tokenizer(words: tuple[str, ...] = VOCAB_WORDS) -> PreTrainedTokenizerFast:
    """Qwen2-like: Qwen2's pre-tokenization, one token per piece (each word with and without its
    leading space), no BOS or EOS added, right padding with <|endoftext|>, the chat template above."""
    vocab = {token: i for i, token in enumerate(QWEN_SPECIALS)}
    for piece in (*_template_pieces(), *(form for word in words for form in (word, " " + word))):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tok.pre_tokenizer = _PRE_TOKENIZER
    tok.add_special_tokens(list(QWEN_SPECIALS))  # matched before normalization, never split
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token=QWEN_PAD,
        unk_token="<unk>",
        padding_side="right",
    )


def template_prefix_length(tokenizer, system_message: str = SYSTEM_MESSAGE) -> int:
    """How many tokens the chat template puts before the user's prompt, as the pipeline formats it:
    the crop `prompt_template_encode_start_idx` must equal this (108 for the real tokenizer)."""
    marker = "<|prompt|>"
    text = tokenizer.apply_chat_template(
        format_text_input([marker], system_message)[0], add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"])


def _freeze(components: dict) -> dict:
    for module in components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    return components


def build_tiny_hunyuan15(
    cfg: TinyHunyuan15Config = TINY_HUNYUAN15, image: bool = False, meanflow: bool = False
) -> dict:
    """The components of `HunyuanVideo15Pipeline`: {text_encoder, tokenizer, transformer, vae, scheduler,
    text_encoder_2, tokenizer_2, guider}; with `image`, those of `HunyuanVideo15ImageToVideoPipeline`
    (plus image_encoder, feature_extractor; the transformer's task_type "i2v"). Every module is in eval
    mode without gradients; both variants share all weights. `meanflow`: the transformer also embeds a
    second timestep (`use_meanflow`, as the step-distilled image-to-video checkpoint), which draws
    other transformer weights."""
    tokenizer = build_qwen_tokenizer(cfg.vocab)
    tokenizer_2 = ByT5Tokenizer()
    # One generator state per component so changing one never changes another's weights.
    torch.manual_seed(cfg.seed)
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=cfg.qwen_dim,
            intermediate_size=cfg.qwen_ffn,
            num_hidden_layers=cfg.qwen_layers,
            num_attention_heads=cfg.qwen_heads,
            num_key_value_heads=cfg.qwen_kv_heads,
            max_position_embeddings=2048,  # >= crop + tokenizer_max_length (1108)
            rope_scaling={"type": "mrope", "mrope_section": list(cfg.mrope_section)},
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    torch.manual_seed(cfg.seed + 1)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * cfg.latent_channels + 1,  # noise, condition latents, condition mask
        out_channels=cfg.latent_channels,
        num_attention_heads=cfg.heads,
        attention_head_dim=cfg.head_dim,
        num_layers=cfg.layers,
        num_refiner_layers=cfg.refiner_layers,
        mlp_ratio=cfg.mlp_ratio,
        patch_size=1,
        patch_size_t=1,
        qk_norm="rms_norm",
        text_embed_dim=cfg.qwen_dim,
        text_embed_2_dim=cfg.t5_dim,
        image_embed_dim=cfg.siglip_dim,
        rope_theta=cfg.rope_theta,
        rope_axes_dim=cfg.rope_axes_dim,
        target_size=cfg.target_size,
        task_type="i2v" if image else "t2v",
        use_meanflow=meanflow,
    )
    torch.manual_seed(cfg.seed + 2)
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3,
        out_channels=3,
        latent_channels=cfg.latent_channels,
        block_out_channels=cfg.vae_channels,
        layers_per_block=cfg.vae_layers,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
        scaling_factor=cfg.scaling_factor,
    )
    torch.manual_seed(cfg.seed + 3)
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=cfg.t5_dim,
            d_kv=cfg.t5_head_dim,
            d_ff=cfg.t5_ffn,
            num_layers=cfg.t5_layers,
            num_heads=cfg.t5_heads,
            feed_forward_proj="gated-gelu",  # as byt5-small
            pad_token_id=tokenizer_2.pad_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
            decoder_start_token_id=tokenizer_2.pad_token_id,
        )
    )
    components = {
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=cfg.flow_shift),
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "guider": ClassifierFreeGuidance(guidance_scale=cfg.guidance_scale),
    }
    if image:
        components.update(_build_image_encoder(cfg))
    return _freeze(components)


def _build_image_encoder(cfg: TinyHunyuan15Config) -> dict:
    """The SigLIP vision tower and its processor: resize to the tower's square input, rescale to
    [0, 1], normalize with mean = std = 0.5 (as siglip-so400m-patch14-384's processor)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    try:  # transformers 5: the PIL backend (SiglipImageProcessor itself needs torchvision there)
        from transformers import SiglipImageProcessorPil as SiglipImageProcessor
    except ImportError:  # transformers 4: SiglipImageProcessor is the PIL one
        from transformers import SiglipImageProcessor

    torch.manual_seed(cfg.seed + 4)
    image_encoder = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=cfg.siglip_dim,
            intermediate_size=2 * cfg.siglip_dim,
            num_hidden_layers=cfg.siglip_layers,
            num_attention_heads=cfg.siglip_heads,
            image_size=cfg.siglip_image_size,
            patch_size=cfg.siglip_patch,
        )
    )
    feature_extractor = SiglipImageProcessor(
        size={"height": cfg.siglip_image_size, "width": cfg.siglip_image_size},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return {"image_encoder": image_encoder, "feature_extractor": feature_extractor}

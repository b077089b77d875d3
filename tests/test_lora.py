"""LoRA adapters (`--lora`, JSONL "loras") against diffusers' own `load_lora_weights` +
`set_adapters` on the same model and file."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import WanPipeline
from safetensors.torch import load_file

from ditango_cli.app import app

ATOL = 1e-5  # float32 on CPU, as the parity tests
TEXT_LEN = 512  # a directory's default, as the CLI runs it
ARGS = ["--steps", "3", "--height", "32", "--width", "48", "--frames", "5", "--guidance", "4.0", "--seed", "5",
        "--negative-prompt", "noise", "--device", "cpu", "--quiet", "--save-latents"]  # fmt: skip


def make_lora(model_dir, out_dir, seed: int, rank: int = 4, alpha: int = 8) -> None:
    """A random LoRA of the model's attention and FFN projections, saved as diffusers saves one
    (peft keys, its config in the safetensors metadata)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = WanPipeline.from_pretrained(model_dir, local_files_only=True)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        init_lora_weights=False,
        target_modules=["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"],
    )
    pipe.transformer.add_adapter(config, adapter_name="x")
    with torch.no_grad():  # peft's random B is small: make the adapter matter at 3 steps
        for name, p in pipe.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    layers = get_peft_model_state_dict(pipe.transformer, adapter_name="x")
    metadata = {k: v for k, v in config.to_dict().items() if k in ("r", "lora_alpha", "target_modules")}
    metadata["target_modules"] = sorted(metadata["target_modules"])
    WanPipeline.save_lora_weights(out_dir, transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata)


@pytest.fixture(scope="module")
def loras(saved_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    for i in (1, 2):
        make_lora(saved_model_dir, root / f"style{i}", seed=i)
    return root


def reference(model_dir, prompt: str, adapters: list[tuple[str, float]]) -> torch.Tensor:
    pipe = WanPipeline.from_pretrained(model_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    for n, (folder, _) in enumerate(adapters):
        pipe.load_lora_weights(folder, adapter_name=f"a{n}")
    if adapters:
        pipe.set_adapters([f"a{n}" for n in range(len(adapters))], [scale for _, scale in adapters])
    return pipe(
        prompt=prompt,
        negative_prompt="noise",
        height=32,
        width=48,
        num_frames=5,
        num_inference_steps=3,
        guidance_scale=4.0,
        generator=torch.Generator("cpu").manual_seed(5),
        output_type="latent",
        max_sequence_length=TEXT_LEN,
    ).frames


def latents_of(out, item_id: str) -> torch.Tensor:
    return load_file(str(out / f"{item_id}.latents.safetensors"))["latents"]


def test_a_lora_gives_diffusers_latents_and_is_recorded(runner, tmp_path, saved_model_dir, loras):
    out = tmp_path / "out"
    args = [
        "generate",
        "--model",
        str(saved_model_dir),
        "--prompt",
        "a red kite",
        "--lora",
        f"{loras / 'style1'}:0.7",
        "--out",
        str(out),
        *ARGS,
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    (item,) = report["items"]
    ours = latents_of(out, item["id"])
    ref = reference(saved_model_dir, "a red kite", [(str(loras / "style1"), 0.7)])
    assert (ours - ref).abs().max().item() <= ATOL
    plain = reference(saved_model_dir, "a red kite", [])
    assert (ref - plain).abs().max().item() > 1e-2, "the LoRA changes the video"
    (lora,) = item["loras"]
    assert (lora["scale"], lora["expert"], len(lora["sha256"])) == (0.7, 1, 64)
    assert report["weights"]["adapters_fused"] is True
    # Another scale of the same file into the same folder: refused, as another step count is.
    again = runner.invoke(app, [a.replace(":0.7", ":0.5") if a.endswith(":0.7") else a for a in args])
    assert again.exit_code == 2 and "made with loras" in again.stderr, again.stderr


def test_a_batch_of_two_sets_loads_the_model_once(runner, tmp_path, saved_model_dir, loras):
    batch = tmp_path / "batch.jsonl"
    lines = [
        {"id": "one", "prompt": "a red kite", "loras": [{"source": str(loras / "style1"), "scale": 0.7}]},
        {"id": "none", "prompt": "a red kite"},
        {"id": "two", "prompt": "a blue boat", "loras": [f"{loras / 'style2'}:1.5", f"{loras / 'style1'}:0.3"]},
    ]
    batch.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["generate", "--model", str(saved_model_dir), "--prompts", str(batch), "--out", str(out), *ARGS]
    )
    assert result.exit_code == 0, result.stderr[-3000:]
    weights = json.loads((out / "report.json").read_text())["weights"]
    assert (weights["model_loads"], weights["adapter_sets"], weights["adapters_fused"]) == (1, 3, False)
    expected = {
        "one": reference(saved_model_dir, "a red kite", [(str(loras / "style1"), 0.7)]),
        "none": reference(saved_model_dir, "a red kite", []),
        "two": reference(saved_model_dir, "a blue boat", [(str(loras / "style2"), 1.5), (str(loras / "style1"), 0.3)]),
    }
    for item_id, ref in expected.items():
        assert (latents_of(out, item_id) - ref).abs().max().item() <= ATOL, item_id


def test_a_lora_that_does_not_fit_is_one_line(runner, tmp_path, saved_model_dir, loras):
    other = tmp_path / "other"
    tensors = load_file(str(loras / "style1" / "pytorch_lora_weights.safetensors"))
    from safetensors.torch import save_file

    other.mkdir()
    save_file(
        {k: torch.zeros(v.shape[0], v.shape[1] + 8) if "lora_A" in k else v for k, v in tensors.items()},
        str(other / "lora.safetensors"),
    )
    pickle = tmp_path / "pickled"
    pickle.mkdir()
    torch.save({"x": torch.zeros(1)}, pickle / "adapter_model.bin")
    for source, needle in [
        (str(other), "lora_A (4, "),
        (str(pickle), "pickle files are never loaded"),
        (str(tmp_path / "missing.safetensors"), "no such file or folder"),
        ("acme/no-such-lora", "not in the Hugging Face cache"),
    ]:
        for command in ("check", "generate"):
            out = tmp_path / "out"
            result = runner.invoke(
                app,
                [
                    command,
                    "--model",
                    str(saved_model_dir),
                    "--prompt",
                    "a",
                    "--lora",
                    source,
                    "--out",
                    str(out),
                    "--device",
                    "cpu",
                ],
            )
            lines = result.stderr.strip().splitlines()
            assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], (command, result.stderr[-2000:])
            assert not out.exists()


STRATEGIES = {
    "ring": ["--gpus", "2", "--parallel", "ring"],
    "ulysses": ["--gpus", "2", "--parallel", "ulysses"],
    "usp": ["--gpus", "4", "--parallel", "usp", "--ulysses-degree", "2"],
    "ditango": ["--gpus", "2", "--parallel", "ditango", "--group-size", "1", "--cache-ratio", "0"],
    "tp": ["--gpus", "2", "--parallel", "tp"],
    "cfg-parallel": ["--gpus", "2", "--cfg-parallel"],
    "shard-weights": ["--gpus", "2", "--parallel", "ring", "--shard-weights"],
}
DIST_ATOL = 1e-4


@pytest.fixture(scope="module")
def styled(saved_model_dir, loras):
    """diffusers' latents of 'a red kite' with style1 at 0.7."""
    return reference(saved_model_dir, "a red kite", [(str(loras / "style1"), 0.7)])


@pytest.mark.distributed
@pytest.mark.sweep
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_lora_is_exact_under_every_strategy(runner, tmp_path, saved_model_dir, loras, styled, strategy):
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(saved_model_dir),
            "--prompt",
            "a red kite",
            "--lora",
            f"{loras / 'style1'}:0.7",
            "--out",
            str(out),
            "--executor",
            "local",
            *STRATEGIES[strategy],
            *ARGS,
        ],
    )
    assert result.exit_code == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    (item,) = report["items"]
    err = (latents_of(out, item["id"]) - styled).abs().max().item()
    assert err <= DIST_ATOL, (strategy, err)
    assert report["weights"]["adapters_fused"] is True and item["loras"][0]["scale"] == 0.7


@pytest.mark.distributed
def test_two_sets_on_two_ranks_switch_per_item(runner, tmp_path, saved_model_dir, loras, styled):
    batch = tmp_path / "batch.jsonl"
    lines = [
        {"id": "styled", "prompt": "a red kite", "loras": [f"{loras / 'style1'}:0.7"]},
        {"id": "plain", "prompt": "a red kite", "loras": []},
    ]
    batch.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(saved_model_dir),
            "--prompts",
            str(batch),
            "--out",
            str(out),
            "--executor",
            "local",
            *STRATEGIES["ulysses"],
            *ARGS,
        ],
    )
    assert result.exit_code == 0, result.stderr[-3000:]
    weights = json.loads((out / "report.json").read_text())["weights"]
    assert (weights["model_loads"], weights["adapter_sets"], weights["adapters_fused"]) == (1, 2, False)
    assert (latents_of(out, "styled") - styled).abs().max().item() <= DIST_ATOL
    plain = reference(saved_model_dir, "a red kite", [])
    assert (latents_of(out, "plain") - plain).abs().max().item() <= DIST_ATOL


def test_several_sets_are_refused_where_weights_are_split(runner, tmp_path, saved_model_dir, loras):
    batch = tmp_path / "batch.jsonl"
    lines = [{"prompt": "a", "loras": [str(loras / "style1")]}, {"prompt": "b"}]
    batch.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    for split in (["--parallel", "tp"], ["--parallel", "ring", "--shard-weights"]):
        result = runner.invoke(
            app,
            [
                "check",
                "--model",
                str(saved_model_dir),
                "--prompts",
                str(batch),
                "--gpus",
                "2",
                "--device",
                "cpu",
                *split,
            ],
        )
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, result.stderr
        assert "2 adapter sets" in lines[0] and "one set per run" in lines[0], lines[0]


def test_a_lora_in_the_wan_authors_format_is_converted_as_diffusers_converts_it(runner, tmp_path, saved_model_dir):
    """A trainer's file in the original Wan module names (diffusion_model.blocks.N.self_attn.q,
    lora_down/lora_up, alpha): diffusers' converter reads it, and the video is diffusers'."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    dim, ffn, rank, tensors = 24, 40, 4, {}
    shapes = {
        "self_attn.q": (dim, dim),
        "self_attn.o": (dim, dim),
        "cross_attn.v": (dim, dim),
        "ffn.0": (ffn, dim),
        "ffn.2": (dim, ffn),
    }
    for block in range(3):
        for name, (out_f, in_f) in shapes.items():
            key = f"diffusion_model.blocks.{block}.{name}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(rank, in_f) * 0.3
            tensors[f"{key}.lora_up.weight"] = torch.randn(out_f, rank) * 0.3
            tensors[f"{key}.alpha"] = torch.tensor(float(rank * 2))
    folder = tmp_path / "wan-format"
    folder.mkdir()
    save_file(tensors, str(folder / "motion.safetensors"))
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(saved_model_dir),
            "--prompt",
            "a red kite",
            "--lora",
            f"{folder / 'motion.safetensors'}:0.7",
            "--out",
            str(out),
            *ARGS,
        ],
    )
    assert result.exit_code == 0, result.stderr[-3000:]
    (item,) = json.loads((out / "report.json").read_text())["items"]
    ref = reference(saved_model_dir, "a red kite", [(str(folder), 0.7)])
    assert (latents_of(out, item["id"]) - ref).abs().max().item() <= ATOL
    assert (ref - reference(saved_model_dir, "a red kite", [])).abs().max().item() > 1e-2


def test_a_hunyuan_lora_gives_the_pipelines_latents(tmp_path):
    """The same path for HunyuanVideo: its pipeline's loader through peft, fused; diffusers'
    latents with `load_lora_weights` + `set_adapters` at 0.7."""
    from diffusers import HunyuanVideoPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from runtime.models.adapter_checks import check_against
    from runtime.models.adapters import AdapterBank, lora_state_dict, parse_lora, resolve
    from tests import test_hunyuan as hy

    trained = hy.build_tiny_hunyuan()["transformer"]
    torch.manual_seed(4)
    trained.add_adapter(
        LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v", "proj_mlp"]),
        adapter_name="x",
    )
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    HunyuanVideoPipeline.save_lora_weights(
        tmp_path, transformer_lora_layers=get_peft_model_state_dict(trained, adapter_name="x")
    )
    adapter = resolve(parse_lora(f"{tmp_path}:0.7"))

    components = hy.build_tiny_hunyuan()
    check_against(adapter, lora_state_dict(HunyuanVideoPipeline, adapter), components["transformer"])
    bank = AdapterBank(HunyuanVideoPipeline(**components), [(adapter,)])
    assert bank.fused and not getattr(components["transformer"], "peft_config", None)
    ours = hy.ours(hy.denoiser(components), hy.SIZES[4], 4.0)

    ref_components = hy.build_tiny_hunyuan()
    pipe = HunyuanVideoPipeline(**ref_components)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(tmp_path, adapter_name="a")
    pipe.set_adapters(["a"], [0.7])
    size = hy.SIZES[4]
    ref = pipe(
        prompt=hy.PROMPT,
        negative_prompt=hy.NEGATIVE,
        true_cfg_scale=4.0,
        guidance_scale=6.0,
        num_inference_steps=hy.STEPS,
        height=size["height"],
        width=size["width"],
        num_frames=size["frames"],
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="latent",
        max_sequence_length=hy.TEXT_LEN,
        prompt_template=hy.prompt_template(ref_components["tokenizer"]),
    ).frames
    assert (ours - ref).abs().max().item() <= ATOL
    assert (ref - hy.diffusers_latents(size, 4.0)).abs().max().item() > 1e-3, "the LoRA changes the video"


def test_ranks_holding_other_weights_are_named_before_the_first_step(parity_components):
    """same_weights: each rank's checksum of its adapted transformer, agreed over the ranks; a
    rank whose weights differ (another file read) stops the run, named."""
    import copy
    from types import SimpleNamespace

    from runtime.models.adapters import same_weights

    components = {"transformer": copy.deepcopy(parity_components["transformer"])}
    hashes = []
    same_weights(components, SimpleNamespace(gather=lambda h: hashes.append(h) or [h, h]))  # agreed: no error
    with torch.no_grad():
        components["transformer"].blocks[0].attn1.to_q.weight[0, 0] += 1e-3
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] differ from rank 0"):
        same_weights(components, SimpleNamespace(gather=lambda h: hashes.append(h) or [hashes[0], h, hashes[0]]))
    assert hashes[1] != hashes[0], "one weight moved by 1e-3 changes the checksum"

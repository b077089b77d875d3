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
    config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=False,
                        target_modules=["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"])  # fmt: skip
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
    return pipe(prompt=prompt, negative_prompt="noise", height=32, width=48, num_frames=5, num_inference_steps=3,
                guidance_scale=4.0, generator=torch.Generator("cpu").manual_seed(5), output_type="latent",
                max_sequence_length=TEXT_LEN).frames  # fmt: skip


def latents_of(out, item_id: str) -> torch.Tensor:
    return load_file(str(out / f"{item_id}.latents.safetensors"))["latents"]


def test_a_lora_gives_diffusers_latents_and_is_recorded(runner, tmp_path, saved_model_dir, loras):
    out = tmp_path / "out"
    args = ["generate", "--model", str(saved_model_dir), "--prompt", "a red kite", "--lora", f"{loras / 'style1'}:0.7",
            "--out", str(out), *ARGS]  # fmt: skip
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
    lines = [{"id": "one", "prompt": "a red kite", "loras": [{"source": str(loras / "style1"), "scale": 0.7}]},
             {"id": "none", "prompt": "a red kite"},
             {"id": "two", "prompt": "a blue boat", "loras": [f"{loras / 'style2'}:1.5", f"{loras / 'style1'}:0.3"]}]  # fmt: skip
    batch.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["generate", "--model", str(saved_model_dir), "--prompts", str(batch),
                                 "--out", str(out), *ARGS])  # fmt: skip
    assert result.exit_code == 0, result.stderr[-3000:]
    weights = json.loads((out / "report.json").read_text())["weights"]
    assert (weights["model_loads"], weights["adapter_sets"], weights["adapters_fused"]) == (1, 3, False)
    expected = {
        "one": reference(saved_model_dir, "a red kite", [(str(loras / "style1"), 0.7)]),
        "none": reference(saved_model_dir, "a red kite", []),
        "two": reference(saved_model_dir, "a blue boat", [(str(loras / "style2"), 1.5), (str(loras / "style1"), 0.3)]),
    }  # fmt: skip
    for item_id, ref in expected.items():
        assert (latents_of(out, item_id) - ref).abs().max().item() <= ATOL, item_id


def test_a_lora_that_does_not_fit_is_one_line(runner, tmp_path, saved_model_dir, loras):
    other = tmp_path / "other"
    tensors = load_file(str(loras / "style1" / "pytorch_lora_weights.safetensors"))
    from safetensors.torch import save_file

    other.mkdir()
    save_file({k: torch.zeros(v.shape[0], v.shape[1] + 8) if "lora_A" in k else v for k, v in tensors.items()},
              str(other / "lora.safetensors"))  # fmt: skip
    pickle = tmp_path / "pickled"
    pickle.mkdir()
    torch.save({"x": torch.zeros(1)}, pickle / "adapter_model.bin")
    for source, needle in [(str(other), "lora_A (4, "), (str(pickle), "pickle files are never loaded"),
                           (str(tmp_path / "missing.safetensors"), "no such file or folder"),
                           ("acme/no-such-lora", "not in the Hugging Face cache")]:  # fmt: skip
        for command in ("check", "generate"):
            out = tmp_path / "out"
            result = runner.invoke(app, [command, "--model", str(saved_model_dir), "--prompt", "a", "--lora", source,
                                         "--out", str(out), "--device", "cpu"])  # fmt: skip
            lines = result.stderr.strip().splitlines()
            assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], (command, result.stderr[-2000:])
            assert not out.exists()

"""Train the built-in model's transformer on the procedural dataset; export a diffusers directory.

    python -m tiny_wan.train --run-dir runs/tiny-wan --max-minutes 85 [--until STEP]
    python -m tiny_wan.train --run-dir runs/tiny-wan --export runtime/models/tiny/weights

Only the transformer learns. The text encoder is frozen at its seeded initialisation and
the VAE is closed-form (`vae.py`), so training latents are exact (`encode_video`).
Objective: rectified flow as Wan is sampled (x_t = (1 - s) x0 + s e, target e - x0,
timestep 1000 s), with s drawn through the same shift as the sampler's schedule and 10%
of captions replaced by the empty prompt for classifier-free guidance.

Reproducible and resumable: the batch of step i is a pure function of (seed, i), and a
checkpoint (safetensors + JSON) is written every few minutes and at the end of each
sitting; `--run-dir` with a checkpoint resumes from it. Progress goes to stdout and
`train.log` in the run directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tiny_wan.build import TRAINED_ARCH, build_tiny_wan
from tiny_wan.data import all_captions, sample_spec
from tiny_wan.vae import encode_video


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 9000
    batch: int = 8
    lr: float = 6e-4
    warmup: int = 300
    min_lr_frac: float = 0.1
    weight_decay: float = 0.01
    ema: float = 0.999
    cond_dropout: float = 0.1
    grad_clip: float = 1.0


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        parts = build_tiny_wan(TRAINED_ARCH)
        self.parts = parts
        self.model = parts["transformer"].train().requires_grad_(True)
        self.ema = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        vae = parts["vae"].config
        self.mean = torch.tensor(vae.latents_mean).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(vae.latents_std).view(1, -1, 1, 1, 1)
        self.shift = float(parts["scheduler"].config.flow_shift)
        self.captions = all_captions()
        self.text = self._embed(self.captions + [""])  # (N+1, L, E); last row: the empty prompt
        self.step = 0
        self.compute_s = 0.0  # wall time spent in training steps, over all sittings
        self.cpu_s = 0.0  # CPU time of those steps (all threads): does not grow when others share the cores
        self.losses: list[float] = []

    @torch.no_grad()
    def _embed(self, prompts: list[str]) -> torch.Tensor:
        from diffusers import WanPipeline

        pipe = WanPipeline(
            **{k: self.parts[k] for k in ("tokenizer", "text_encoder", "vae", "scheduler")}, transformer=None
        )
        embeds, _ = pipe.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=TRAINED_ARCH.max_text_len
        )
        return embeds

    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        frac = (step - c.warmup) / max(1, c.steps - c.warmup)
        return c.lr * (c.min_lr_frac + (1 - c.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x0, noise, sigma, text) of one step: a pure function of (seed, step)."""
        c = self.cfg
        specs = [sample_spec(c.seed * 1_000_000_007 + step * c.batch + j) for j in range(c.batch)]
        video = torch.stack([s.render() for s in specs])
        x0 = (encode_video(video) - self.mean) / self.std
        g = torch.Generator().manual_seed(c.seed * 7919 + step)
        noise = torch.randn(x0.shape, generator=g)
        u = torch.rand(c.batch, generator=g)
        sigma = self.shift * u / (1 + (self.shift - 1) * u)  # the sampler's shifted schedule
        rows = torch.tensor([self.captions.index(s.caption) for s in specs])
        drop = torch.rand(c.batch, generator=g) < c.cond_dropout
        rows[drop] = len(self.captions)
        return x0, noise, sigma, self.text[rows]

    def train_step(self) -> float:
        x0, noise, sigma, text = self.batch(self.step)
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        pred = self.model(hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=text, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        with torch.no_grad():
            decay = min(self.cfg.ema, (1 + self.step) / (10 + self.step))
            for k, v in self.model.state_dict().items():
                self.ema[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
        self.step += 1
        return float(loss.detach())

    # --- checkpoints: safetensors for tensors, JSON for the rest ---------------------------

    def save(self) -> None:
        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        tensors |= {f"ema.{k}": v for k, v in self.ema.items()}
        opt = self.opt.state_dict()
        for i, state in opt["state"].items():
            for name, value in state.items():
                tensors[f"opt.{i}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
        tmp = self.run_dir / "checkpoint.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        meta = {
            "step": self.step,
            "compute_s": self.compute_s,
            "cpu_s": self.cpu_s,
            "config": asdict(self.cfg),
            "losses": self.losses,
        }
        (self.run_dir / "checkpoint.json.tmp").write_text(json.dumps(meta))
        os.replace(tmp, self.run_dir / "checkpoint.safetensors")
        os.replace(self.run_dir / "checkpoint.json.tmp", self.run_dir / "checkpoint.json")

    def load(self) -> bool:
        meta_path = self.run_dir / "checkpoint.json"
        if not meta_path.exists():
            return False
        meta = json.loads(meta_path.read_text())
        if meta["config"] != asdict(self.cfg):
            raise SystemExit(f"error: {self.run_dir} was trained with {meta['config']}; pass the same settings")
        tensors = load_file(str(self.run_dir / "checkpoint.safetensors"))
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        self.ema = {k[4:]: v for k, v in tensors.items() if k.startswith("ema.")}
        opt = self.opt.state_dict()
        for key, value in tensors.items():
            if key.startswith("opt."):
                _, i, name = key.split(".", 2)
                opt["state"].setdefault(int(i), {})[name] = value
        self.opt.load_state_dict(opt)
        self.step, self.compute_s, self.losses = meta["step"], meta["compute_s"], meta["losses"]
        self.cpu_s = meta.get("cpu_s", 0.0)
        return True

    def export(self, out: Path) -> None:
        """The EMA transformer with the frozen text side and closed-form VAE, as a diffusers directory."""
        from diffusers import WanPipeline

        model = self.parts["transformer"]
        model.load_state_dict(self.ema)
        model.eval().requires_grad_(False)
        WanPipeline(**self.parts).save_pretrained(str(out), safe_serialization=True)


def log(run_dir: Path, line: str) -> None:
    print(line, flush=True)
    with open(run_dir / "train.log", "a") as f:
        f.write(line + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True, help="checkpoints and train.log; resumed when present")
    ap.add_argument("--max-minutes", type=float, default=85.0, help="stop this sitting after this much wall time")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--export", type=Path, help="write the EMA model as a diffusers directory and exit")
    ap.add_argument(
        "--until",
        type=int,
        default=None,
        help="end training at this step (the learning-rate schedule stays that of --steps)",
    )
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--checkpoint-minutes", type=float, default=5.0)
    for f in TrainConfig.__dataclass_fields__.values():
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(**{k: getattr(args, k) for k in TrainConfig.__dataclass_fields__})
    args.run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    trainer = Trainer(cfg, args.run_dir)
    resumed = trainer.load()
    if args.export:
        trainer.export(args.export)
        log(args.run_dir, f"exported step {trainer.step} (EMA) to {args.export}")
        return
    log(args.run_dir, f"{'resumed at' if resumed else 'starting'} step {trainer.step}/{cfg.steps}, {asdict(cfg)}")
    stop = []  # SIGTERM / SIGINT: finish the step, write a checkpoint, exit (pause a sitting)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    start = last_ckpt = time.monotonic()
    window: list[float] = []
    window_start = time.monotonic()
    end = min(cfg.steps, args.until or cfg.steps)
    while trainer.step < end and time.monotonic() - start < args.max_minutes * 60 and not stop:
        t0, c0 = time.monotonic(), time.process_time()
        window.append(trainer.train_step())
        trainer.compute_s += time.monotonic() - t0
        trainer.cpu_s += time.process_time() - c0
        if trainer.step % args.log_every == 0:
            mean = sum(window) / len(window)
            trainer.losses.append(round(mean, 5))
            rate = len(window) * cfg.batch / (time.monotonic() - window_start)
            log(
                args.run_dir,
                f"step {trainer.step} loss {mean:.4f} lr {trainer.lr_at(trainer.step):.2e} "
                f"{rate:.1f} samples/s compute {trainer.compute_s / 60:.1f} min cpu {trainer.cpu_s / 60:.1f} min",
            )
            window, window_start = [], time.monotonic()
        if time.monotonic() - last_ckpt > args.checkpoint_minutes * 60:
            trainer.save()
            last_ckpt = time.monotonic()
    trainer.save()
    log(
        args.run_dir,
        f"checkpoint at step {trainer.step}, compute {trainer.compute_s / 60:.1f} min, cpu {trainer.cpu_s / 60:.1f} min",
    )


if __name__ == "__main__":
    main()

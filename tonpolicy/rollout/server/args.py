"""Arguments of the embedded rollout server: from a resolved run config file, or from flags.

`--config` takes the resolved config the launcher writes (YAML or JSON; the `Config` schema of
tonpolicy.config.schema): `contract` gives the kernel set, dtype, tile sizes and identity, `model`
the profile and checkpoint, `rollout` the host/port and batching limits. Flags given alongside
`--config` override it. The file is read by tonpolicy.config.compose.load_config, as the trainer
reads it; the contract identity is computed from it by tonpolicy.contract (`--contract-fingerprint`
overrides it).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf.errors import OmegaConfBaseException

from tonpolicy.config.compose import load_config
from tonpolicy.config.device import cuda_graphs_on, resolve_device
from tonpolicy.config.dtypes import DTYPES
from tonpolicy.config.model import ModelConfig
from tonpolicy.config.schema import Config
from tonpolicy.config.server_access import API_KEY_ENV
from tonpolicy.contract.identity import KERNEL_PARAM_FIELDS, identity, kernel_params


@dataclass
class ServerArgs:
    contract_name: str
    contract_version: int | str
    contract_fingerprint: str
    # HF checkpoint directory (config.json + safetensors); None: random init of `model` from its seed.
    model_path: str | None = None
    # The run's model profile; a checkpoint must match its architecture. None: ModelConfig() when
    # there is no checkpoint, the checkpoint's own config.json otherwise.
    model: ModelConfig | None = None
    kernels: str = "ordered"
    kernel_params: dict[str, Any] = field(default_factory=dict)
    dtype: str = "bfloat16"
    max_running_requests: int = 8
    chunked_prefill_size: int | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port; it is printed and written to port_file
    port_file: str | None = None
    random_seed: int = 0  # base of the per-request seed when a request gives no sampling_seed
    weight_version: str = "default"
    num_threads: int | None = None
    log_requests: bool = False
    device: str = "cpu"  # "cpu" | "cuda": where the engine runs (the run config's trainer.device)
    # As SGLang's flag: do not load the checkpoint's tokenizer (token ids in and out only).
    skip_tokenizer_init: bool = False
    # As SGLang's --api-key: every route but /health* needs `Authorization: Bearer KEY`. The launcher
    # passes it as $TONPOLICY_API_KEY instead, so it is not on the command line.
    api_key: str | None = None
    # As SGLang's --disable-radix-cache: no prefix cache (every prompt is prefilled in full).
    disable_radix_cache: bool = False
    # Decode steps in CUDA graphs per batch-size bucket (rollout.cuda_graphs; needs device cuda).
    cuda_graphs: bool = False


def args_from_config(cfg: Config) -> dict[str, Any]:
    """Resolved run config (the typed schema, read as the trainer reads it) -> ServerArgs keywords."""
    c, r = cfg.contract, cfg.rollout
    ident = identity(c)
    out: dict[str, Any] = {
        "contract_name": ident.name,
        "contract_version": ident.version,
        "contract_fingerprint": ident.fingerprint,
        "kernels": c.kernels,
        "dtype": c.dtype,
        "kernel_params": kernel_params(c),
        "model": cfg.model,
        "model_path": cfg.model.checkpoint,
        "host": r.host,
        "port": r.port,
        "max_running_requests": r.max_running_requests,
        "skip_tokenizer_init": r.skip_tokenizer_init,
        "disable_radix_cache": r.disable_radix_cache,
        "random_seed": cfg.experiment.seed,
        "device": resolve_device(cfg),  # the engine follows the trainer
        "cuda_graphs": cuda_graphs_on(cfg),
    }
    if r.chunked_prefill_size is not None:
        out["chunked_prefill_size"] = r.chunked_prefill_size
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tonpolicy.rollout.server",
        description="tonpolicy's embedded rollout server, speaking SGLang's HTTP protocol.",
    )
    p.add_argument("--config", help="resolved run config (YAML or JSON); flags below override it")
    p.add_argument("--model-path", help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--kernels", help="kernel set name (tonpolicy.kernels.get_kernels)")
    for name in KERNEL_PARAM_FIELDS:
        kind = str if name in ("logits_dtype", "quant") else int
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"kernel set parameter {name}")
    p.add_argument("--dtype", choices=list(DTYPES))
    p.add_argument("--contract-name")
    p.add_argument("--contract-version")
    p.add_argument("--contract-fingerprint")
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="0 (default) picks a free port")
    p.add_argument("--port-file", help="write the bound port here (atomically) once listening")
    p.add_argument("--random-seed", type=int)
    p.add_argument("--weight-version")
    p.add_argument("--num-threads", type=int, help="torch intra-op threads")
    p.add_argument("--device", choices=("cpu", "cuda"), help="where the engine runs (default cpu)")
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode in CUDA graphs per batch-size bucket (needs --device cuda)",
    )
    p.add_argument("--log-requests", action="store_true", default=None, help="log every HTTP request")
    p.add_argument(
        "--disable-radix-cache", action="store_true", default=None, help="no prefix cache (as SGLang's flag)"
    )
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` (default: $TONPOLICY_API_KEY, if set)")
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        default=None,
        help="do not load the checkpoint's tokenizer: token ids only (as SGLang's flag)",
    )
    return p


def parse_server_args(argv: list[str] | None = None) -> ServerArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if ns.config:
        try:
            values.update(args_from_config(load_config(ns.config)))
        except (OSError, ValueError, KeyError, yaml.YAMLError, OmegaConfBaseException) as e:
            parser.error(f"cannot read --config {ns.config}: {e}")
    for key, value in vars(ns).items():
        if key == "config" or value is None:
            continue
        if key in KERNEL_PARAM_FIELDS:
            values.setdefault("kernel_params", {})[key] = value
        else:
            values[key] = value
    missing = [k for k in ("contract_name", "contract_version", "contract_fingerprint") if k not in values]
    if missing:
        flags = ", ".join("--" + k.replace("_", "-") for k in missing)
        parser.error(f"the contract identity is required: give {flags} or a --config with a contract")
    values.setdefault("api_key", os.environ.get(API_KEY_ENV) or None)
    version = values["contract_version"]
    if isinstance(version, str) and version.isdigit():  # flags are strings; the schema's version is an int
        values["contract_version"] = int(version)
    return ServerArgs(**values)

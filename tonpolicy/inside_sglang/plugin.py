"""tonpolicy's SGLang plugin: the contract sampler in every SGLang process that serves the contract model
package, however SGLang was started (`python -m sglang.launch_server`, `sglang.Engine(...)`, tonpolicy's
own server entry).

SGLang runs the general plugins installed packages declare (entry-point group `sglang.srt.plugins`,
tonpolicy's in pyproject.toml) at the start of its processes: the server's or the engine's, and each
scheduler's, before the scheduler creates its sampler. The model package itself is imported only when
the model is loaded, after the sampler exists, so it cannot choose the sampler; this hook can. It does
nothing unless SGLANG_EXTERNAL_MODEL_PACKAGE names tonpolicy's model package, so other models served
from the same environment keep SGLang's own sampler. `SGLANG_PLUGINS`, when set, must list
`tonpolicy_contract_sampler`.
"""

from __future__ import annotations

import os

MODEL_PACKAGE = f"{__package__}.model"
MODEL_PACKAGE_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"


def register() -> None:
    """SGLang's entry point: register the contract sampler when this process serves the model package."""
    if os.environ.get(MODEL_PACKAGE_ENV) != MODEL_PACKAGE:
        return
    from tonpolicy.inside_sglang.model.heads import register_contract_sampler

    register_contract_sampler()

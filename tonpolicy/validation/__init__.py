"""Validation, above the registries it reads (kernel sets, rollout backends, tasks): every rule checked
and every violation reported at once (`validate`), and the command line checked before Hydra acts on
it (`command_line`)."""

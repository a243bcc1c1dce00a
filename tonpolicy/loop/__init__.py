"""The step loop of a run, on the trainer ranks: a step's batch (`batch`), the exact-zero gate's
policy (`gate`), weight sync to the rollout server (`weight_sync`), the step records (`records`),
the exit codes of a job (`exit_codes`), test fault hooks (`faults`) and the loop itself (`run`)."""

"""The step loop of a run, on the trainer ranks: the loop itself (`run`, the order of docs/ARCHITECTURE.md's
step list), the logprob reference chosen once per run (`logprob_reference`), a step's batch from the rollouts
(`rollout_batch`), the exact-zero gate's policy (`gate_policy`), weight sync to the rollout server
(`weight_sync`), the step's record (`step_record`) and the records and status file (`records`),
asynchronous steps (`producer`, `staleness`), checkpoints and resume (`checkpoints`, `resume`), held-out
evaluation (`evaluation`), rank 0's broadcasts (`collective`), the exit codes of a job (`exit_codes`)
and test fault hooks (`faults`)."""

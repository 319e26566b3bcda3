"""Launching: how a job is started and what a process learns from that (`env.read_launch_env`, the one place
the environment is read), `toolkit launch`'s plan for a profile (`launcher`), accelerate profiles
(`profiles`), multi-node rendezvous checks (`rendezvous`), launchers run without their tracebacks (`quiet`),
and `spawn` for notebooks and plain scripts."""

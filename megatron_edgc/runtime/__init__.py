"""The per-step EDGC machinery both front-ends share (this project's trainer and the
Megatron-LM plug-in): the runtime around a step, the driver that turns measurements into
rank tables, the checkpoint registry of their state, and the telemetry writers."""

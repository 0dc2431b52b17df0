"""The control plane: router <-> engine messages, the engine process loop, registration and heartbeats,
and the one socket factory (options + CURVE) every plane uses."""

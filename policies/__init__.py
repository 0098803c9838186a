"""Flow-matching VLA policies (encoders, action expert, samplers, value heads). Coming with the policy issue."""

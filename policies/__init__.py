"""Flow-matching VLA policies: encoders, action expert, samplers (ODE, SDE, learnable noise).

``policies.flow_vla`` holds the model (LeRobot-style ``configuration_flow_vla`` / ``modeling_flow_vla``
split). Value/critic heads and LeRobot adapters join as their issues land.
"""

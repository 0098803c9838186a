"""Flow-matching VLA policies: encoders, action expert, samplers (ODE, SDE, learnable noise).

``policies.flow_vla`` holds the model (LeRobot-style ``configuration_flow_vla`` / ``modeling_flow_vla``
split). ``policies.lerobot_adapter`` serves LeRobot policies (ACT, Diffusion, PI0, ...) from their
``save_pretrained`` folders. Value/critic heads join as their issues land.
"""

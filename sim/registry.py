"""The task table: every simulated task vla-rl knows, and the one factory that builds them."""

from __future__ import annotations

from sim.base import EnvOptions, GoalLayout, ObsMode, RewardMode, SimEnv, TaskInfo

TASKS: dict[str, TaskInfo] = {
    t.name: t
    for t in (
        TaskInfo(
            "maniskill/PushCube-v1",
            "maniskill",
            "PushCube-v1",
            "push the cube into the target region",
            50,
            ("base_camera",),
            {"state": 35, "rgb": 25},
        ),
        TaskInfo(
            "maniskill/PickCube-v1",
            "maniskill",
            "PickCube-v1",
            "pick up the cube and move it to the goal",
            50,
            ("base_camera",),
            {"state": 42, "rgb": 29},
            # state: qpos 0:9, qvel 9:18, is_grasped 18, tcp_pose 19:26, goal_pos 26:29, obj_pose 29:36,
            # tcp_to_obj 36:39, obj_to_goal 39:42; success = cube within 2.5 cm of the goal, arm at rest
            goal_layout=GoalLayout(goal=26, achieved=29, to_goal=(39,), held=18, still=(9, 16)),
        ),
        # ManiSkill's default 50 steps leave the expert too little room once noise is added.
        TaskInfo(
            "maniskill/StackCube-v1",
            "maniskill",
            "StackCube-v1",
            "stack the red cube on top of the green cube",
            80,
            ("base_camera", "hand_camera"),
            {"state": 48, "rgb": 25},
        ),
        TaskInfo(
            "robosuite/Lift",
            "robosuite",
            "Lift",
            "lift the cube off the table",
            80,
            ("agentview",),
            {"state": 60, "rgb": 50},
        ),
        # No physics engine: thousands of steps/s, for tests that an algorithm learns (sim/kinematic.py).
        TaskInfo(
            "kinematic/Reach-v0",
            "kinematic",
            "Reach-v0",
            "move the gripper to the goal and close it there",
            20,
            ("top_camera",),
            {"state": 7, "rgb": 4},
            # state: gripper xyz 0:3, goal xyz 3:6, gripper closed 6; success = closed within 1.5 cm
            goal_layout=GoalLayout(goal=3, achieved=0, held=6),
        ),
    )
}


def list_tasks() -> list[TaskInfo]:
    return list(TASKS.values())


def resolve_task(task: str) -> TaskInfo:
    """Accept the full id (``maniskill/PickCube-v1``) or a unique short form (``PickCube``)."""
    if task in TASKS:
        return TASKS[task]
    matches = [t for t in TASKS.values() if task.lower() in t.name.lower()]
    if len(matches) == 1:
        return matches[0]
    raise ValueError(f"task: expected one of {sorted(TASKS)} (or a unique part of one), got {task!r}")


def sim_task_name(task: str) -> str | None:
    """The full id of the simulated task ``task`` names, or None when it names none (e.g. a task of
    imported robot data, which only offline evaluation can score)."""
    try:
        return resolve_task(task).name
    except ValueError:
        return None


def make_env(
    task: str,
    obs: ObsMode = "state",
    image_size: int = 128,
    max_episode_steps: int | None = None,
    reward: RewardMode = "dense",
    render_size: int | None = None,
    replayable: bool = False,
) -> SimEnv:
    """Build one simulated robot for ``task`` (see :func:`list_tasks`; options: :class:`EnvOptions`)."""
    info = resolve_task(task)
    options = EnvOptions(
        obs=obs,
        image_size=image_size,
        max_episode_steps=max_episode_steps,
        reward=reward,
        render_size=render_size,
        replayable=replayable,
    )
    if info.backend == "maniskill":
        from sim.maniskill import ManiSkillEnv

        return ManiSkillEnv(info, options)
    if info.backend == "kinematic":
        from sim.kinematic import KinematicReachEnv

        return KinematicReachEnv(info, options)
    from sim.robosuite_env import RobosuiteEnv

    return RobosuiteEnv(info, options)

"""The schedules: how a step's rollout and its prompt work share the devices.

One module per schedule, each a `Schedule` (rollplex.rl.schedules.base) with the
same few hooks: before decode, between decode steps, after decode.
`build_schedule` (rollplex.rl.schedules.registry) is the only reader of
`schedule.kind`. This package's own module imports nothing, so that the memory
plan can read the prompt-work items (`prompt_items`) without a cycle.
"""

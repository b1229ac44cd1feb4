"""Pure math: masked tensor ops, losses, advantage estimators, running statistics and LR schedules. No model, no
I/O; every function has its formula, shapes and a worked example in its docstring, and tests with hand-computed
values."""

"""`python -m recurrent_depth.evaluation.tasks` prints the directory to pass to lm-eval's --include_path."""

from recurrent_depth.evaluation.tasks import TASKS_DIR

print(TASKS_DIR)

"""Making expert drafters: training prompts, the target's own answers, distillation, evaluation."""

"""Rank 0's request side: the step loop, scheduler, prompts, constraints, answers,
speculation's proposals and rule, the prefix index and the budgets."""

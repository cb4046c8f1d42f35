"""Agentic multi-turn rollouts (issue 41): tools and environments the model acts on between its turns."""

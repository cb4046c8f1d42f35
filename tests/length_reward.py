"""A reward for tests that varies within a group: the response's length in characters, mod 3."""


def reward(response: str, answer: str) -> float:
    return float(len(response) % 3)

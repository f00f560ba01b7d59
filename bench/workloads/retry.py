import random
import time


def backoff(attempt, base_delay=0.2, max_delay=5.0):
    """The pause before try `attempt` (from 1): doubling, capped, with jitter."""
    delay = min(base_delay * 2 ** (attempt - 1), max_delay)
    return delay + random.uniform(0, delay / 2)


def retry(call, attempts=4):
    """Call `call()` until it succeeds or `attempts` run out."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except ConnectionError:
            if attempt == attempts:
                raise
            time.sleep(backoff(attempt))

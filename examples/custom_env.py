"""A custom tool environment in one file.

    python examples/custom_env.py                 # play one scripted episode
    relax-gym check examples/custom_env.py        # conformance-check what it registers
"""

import relax_gym
from relax_gym import ToolEnv, tool
from relax_gym.rewards import exact_match_reward, extract_tag

PRICES = {"apple": 3, "bread": 5, "cheese": 9, "milk": 4, "tea": 7}


class ShoppingEnv(ToolEnv):
    """Add up a shopping list, looking each price up with a tool."""

    max_turns = 4
    system_prompt = "Look prices up with the `price` tool, then reply <answer>TOTAL</answer>."

    def new_task(self, rng, options):
        items = sorted(rng.choice(sorted(PRICES), size=int(rng.integers(2, 4)), replace=False).tolist())
        return {"prompt": f"What do {', '.join(items)} cost together?", "answer": str(sum(PRICES[i] for i in items))}

    @tool
    def price(self, item: str) -> int:
        """Looks up the price of one item.

        Args:
            item: the item's name, e.g. "apple"
        """
        return PRICES[item.strip().lower()]  # an unknown item becomes an error message the model reads

    def score(self, answer: str):
        return exact_match_reward(extract_tag(answer) or "", self.episode["task"]["answer"])


relax_gym.register("example/Shopping-v0", ShoppingEnv)

if __name__ == "__main__":
    env = relax_gym.make("example/Shopping-v0")
    obs, info = env.reset(seed=0)
    print(obs[-1]["content"][0]["text"])
    obs, *_ = env.step('<tool_call>{"name": "price", "arguments": {"item": "apple"}}</tool_call>')
    print("tool says:", obs[0]["content"][0]["text"])
    obs, reward, terminated, truncated, info = env.step(f"<answer>{env.episode['task']['answer']}</answer>")
    print("reward", reward, info["reward"])

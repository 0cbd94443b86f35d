"""Custom environments in one file: a one-turn env and a tool env, written with the same four hooks.

    python examples/custom_env.py                                   # play a scripted episode of each
    relax-gym check examples/custom_env.py                          # conformance-check what it registers
    relax-gym check examples/custom_env.py:ShoppingQuizEnv          # ... or a class by name
"""

import relax_gym
from relax_gym import SingleTurnEnv, ToolEnv, tool
from relax_gym.messages import message
from relax_gym.rewards import exact_match_reward, extract_tag

PRICES = {"apple": 3, "bread": 5, "cheese": 9, "milk": 4, "tea": 7}


def shopping_list(rng):
    """Two or three distinct items, drawn from `rng` only so a seed names the task."""
    items = sorted(rng.choice(sorted(PRICES), size=int(rng.integers(2, 4)), replace=False).tolist())
    return {"items": items, "answer": str(sum(PRICES[i] for i in items))}


class ShoppingQuizEnv(SingleTurnEnv):
    """Add up a shopping list whose prices are in the prompt; one answer, graded."""

    def new_task(self, rng, options):
        return shopping_list(rng)

    def prompt_messages(self, task):
        prices = ", ".join(f"{item} costs {price}" for item, price in PRICES.items())
        question = f"{prices}. What do {', '.join(task['items'])} cost together? Reply <answer>TOTAL</answer>."
        return [message("user", question)]

    def grade(self, task, answer):
        return exact_match_reward(extract_tag(answer) or "", task["answer"])

    def task_info(self, task):
        return {"n_items": len(task["items"])}


class ShoppingEnv(ToolEnv):
    """Add up a shopping list, looking each price up with a tool."""

    max_turns = 4
    system_prompt = "Look prices up with the `price` tool, then reply <answer>TOTAL</answer>."

    def new_task(self, rng, options):
        return shopping_list(rng)

    def prompt_messages(self, task):
        question = f"What do {', '.join(task['items'])} cost together?"
        return [message("system", self.system_prompt), message("user", question)]

    def grade(self, task, answer):  # the final reply's content: no tool calls, no reasoning
        return exact_match_reward(extract_tag(answer) or "", task["answer"])

    def task_info(self, task):
        return {"n_items": len(task["items"])}

    @tool
    def price(self, item: str) -> int:
        """Looks up the price of one item.

        Args:
            item: the item's name, e.g. "apple"
        """
        return PRICES[item.strip().lower()]  # an unknown item becomes an error message the model reads


relax_gym.register("example/Shopping-v0", ShoppingEnv)

if __name__ == "__main__":
    quiz = ShoppingQuizEnv()
    obs, info = quiz.reset(seed=0)
    print(obs[-1]["content"][0]["text"])
    print("reward", quiz.step(f"<answer>{quiz.task['answer']}</answer>")[1])

    env = relax_gym.make("example/Shopping-v0")
    obs, info = env.reset(seed=0)
    print(obs[-1]["content"][0]["text"])
    obs, *_ = env.step('<tool_call>{"name": "price", "arguments": {"item": "apple"}}</tool_call>')
    print("tool says:", obs[0]["content"][0]["text"])
    obs, reward, terminated, truncated, info = env.step(f"<answer>{env.task['answer']}</answer>")
    print("reward", reward, info["reward"])

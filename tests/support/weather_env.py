"""A weather tool env for real models' own tool calls: asked a city's temperature, look it up with
`get_weather`, answer with the number. A plain user question, as people ask it, with no format taught in
the prompt beyond what the model's chat template says about tools."""

import relax_gym
from relax_gym import ToolEnv, tool
from relax_gym.messages import message
from relax_gym.rewards import RewardResult

TEMPERATURES = {"Paris": 18, "Oslo": 4, "Cairo": 31, "Lima": 22}


class WeatherEnv(ToolEnv):
    max_turns = 2

    def new_task(self, rng, options):
        city = sorted(TEMPERATURES)[int(rng.integers(len(TEMPERATURES)))]
        return {"city": city, "answer": str(TEMPERATURES[city])}

    def prompt_messages(self, task):
        return [message("user", f"What is the weather like in {task['city']} today?")]

    def grade(self, task, answer):
        return RewardResult(float(task["answer"] in answer), "ok")

    def task_info(self, task):
        return {"city": task["city"]}

    @tool
    def get_weather(self, city: str) -> str:
        """Gets the current weather in a city.

        Args:
            city: the city's name, e.g. Paris
        """
        if city not in TEMPERATURES:
            raise ValueError(f"no weather for {city!r}; known cities: {', '.join(sorted(TEMPERATURES))}")
        return f"{TEMPERATURES[city]} °C and sunny in {city}"


relax_gym.register("test/Weather-v0", WeatherEnv)

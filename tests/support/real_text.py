"""Real text for a real model: chat questions and long passages.

Written for this repository (no dataset is downloaded). The tests check the engine against
Hugging Face on these prompts and the benchmarks run them, so both see a chat model's real
prompt-length mix: short questions, and a share of long ones that quote a passage and so are
split into chunks by a small prefill budget.
"""

from __future__ import annotations

import random
from typing import Any

QUESTIONS: tuple[str, ...] = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Name three primary colors.",
    "Explain in two sentences why the sky is blue.",
    "Give me a short tip for learning a new language.",
    "What is the boiling point of water at sea level in Celsius?",
    "Translate 'good morning' into Spanish.",
    "Who wrote the play Romeo and Juliet?",
    "List three fruits that are yellow.",
    "What does a CPU do in a computer?",
    "Suggest a name for a friendly robot.",
    "How many days are there in a leap year?",
    "Describe a cat in one sentence.",
    "What is the largest planet in the solar system?",
    "Write one sentence about the importance of sleep.",
    "What is photosynthesis? Keep it short.",
    "Give an example of a renewable energy source.",
    "What is the opposite of 'ancient'?",
    "How do you make a cup of tea?",
    "What is the square root of 81?",
    "Tell me a fun fact about octopuses.",
    "Why do we have seasons on Earth?",
    "Write a short greeting for a birthday card.",
)

PASSAGES: tuple[str, ...] = (
    """The history of the bicycle begins in the early nineteenth century. In 1817 Karl Drais, a
German inventor, built a two-wheeled machine with no pedals that riders pushed along with their
feet; it was called the running machine or the dandy horse. Over the following decades inventors
in France and Britain added cranks and pedals to the front wheel, which led to the velocipede,
nicknamed the boneshaker because of its iron tyres and rough ride on cobbled streets. In the
1870s the high-wheeler appeared. Its huge front wheel let a rider travel further with each turn
of the pedals, but it was dangerous: a rider who struck a stone could be thrown over the
handlebars. The safety bicycle of the 1880s solved this problem with two wheels of equal size and
a chain that drove the rear wheel. When John Dunlop introduced the pneumatic tyre in 1888, the
modern bicycle was essentially complete. Bicycles soon changed daily life. They gave working
people cheap personal transport, helped women gain independence of movement, and pushed
governments to build smoother roads, which later served the motor car. Today more than a billion
bicycles are in use around the world, and many cities build protected lanes to encourage cycling
as a healthy, quiet and clean way to travel.""",
    """Honey bees live in colonies that can hold tens of thousands of individuals. Each colony has
a single queen, who lays the eggs, a few hundred male drones, whose role is to mate with queens
from other colonies, and a great many female worker bees. Workers change jobs as they age. Young
workers clean cells and feed larvae; older ones build wax comb, guard the entrance and finally
leave the hive to collect nectar, pollen, water and plant resin. A forager that finds a rich
patch of flowers returns and performs a waggle dance on the comb. The angle of the dance relative
to vertical tells her sisters the direction of the food relative to the sun, and the length of
the waggle run tells them the distance. Nectar is carried back in a special honey stomach,
passed from bee to bee, and stored in cells where the bees fan their wings to evaporate water
until it thickens into honey. The colony lives on this honey through the winter, clustering
together and shivering their flight muscles to keep the centre of the cluster warm. Bees are
important pollinators of crops such as apples, almonds and clover, which is why farmers and
scientists worry about the diseases, parasites and pesticides that have weakened many colonies.""",
    """The water cycle describes how water moves between the oceans, the air and the land. Heat
from the sun evaporates water from seas, lakes and rivers, and plants release water vapour from
their leaves in a process called transpiration. The warm, moist air rises and cools, and the
vapour condenses around tiny particles of dust to form clouds. When the droplets in a cloud grow
large enough, they fall as precipitation: rain, snow, sleet or hail, depending on the
temperature of the air they fall through. Some of this water runs off the surface into streams
and rivers and flows back to the sea. Some soaks into the ground, where it refills aquifers and
may stay for thousands of years before it reaches a spring or a well. In cold regions water can
be locked away as ice in glaciers and ice sheets, which store most of the fresh water on the
planet. The water cycle also moves heat around the globe, because evaporation absorbs energy and
condensation releases it. Changes in climate alter the cycle: warmer air holds more moisture,
which can make heavy rain more intense in some places while other regions face longer droughts.
Understanding these patterns helps engineers plan reservoirs and helps farmers decide what to
plant.""",
    """A compiler translates a program written in a high-level language into instructions a
machine can run. It usually works in stages. The lexer reads the source text and groups
characters into tokens such as names, numbers and operators. The parser arranges these tokens
into a tree that reflects the grammar of the language, and it reports an error when the program
is not well formed. Semantic analysis then checks that names are declared before they are used
and that types match, for example that a number is not added to a list. Many compilers next
translate the tree into an intermediate representation that is easier to analyse than the
source and simpler than machine code. Optimisation passes work on this representation: they
remove code that can never run, compute constant expressions ahead of time, keep frequently used
values in registers and move work out of loops. Finally the code generator chooses real machine
instructions and lays them out in memory. Some languages skip part of this pipeline. An
interpreter runs the program directly from the tree or from a compact bytecode, and a just in
time compiler translates the hottest parts of a running program into machine code while it
runs, trading a little start-up time for much faster loops.""",
)

LONG_TASKS: tuple[str, ...] = (
    "Summarize the text above in two sentences.",
    "What is the main topic of the text above? Answer briefly.",
    "List two facts from the text above.",
    "Write a title for the text above.",
)


# The share of prompts that quote a passage (~300 tokens on SmolLM2; questions are ~40).
LONG_FRACTION = 0.25


def chat_messages(rng: random.Random, long_fraction: float) -> list[dict[str, str]]:
    """One user turn: a short question, or (with probability `long_fraction`) a passage and a
    task about it."""
    if rng.random() < long_fraction:
        text = f"{rng.choice(PASSAGES)}\n\n{rng.choice(LONG_TASKS)}"
    else:
        text = rng.choice(QUESTIONS)
    return [{"role": "user", "content": text}]


def chat_prompts(tokenizer: Any, n: int, seed: int = 0, long_fraction: float = LONG_FRACTION) -> list[list[int]]:
    """`n` chat-templated prompts (token ids, the model's own template with the generation
    prompt), the same for a given seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = tokenizer.apply_chat_template(chat_messages(rng, long_fraction), tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out

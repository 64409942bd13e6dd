"""Write ``fables.txt``: the training text of ``examples/train_char.py``.

The text is generated here, from a small hand-written grammar of fables, so it
is ours to ship (public domain, CC0) and needs no download. It is regular
enough for a tiny character model to learn words, agreement and punctuation in
a few hundred steps, and varied enough that it cannot memorise it.

    python examples/data/make_corpus.py            # rewrites examples/data/fables.txt

The output is deterministic (seeded), so the shipped file can be checked:
running this script again must leave ``git diff`` empty.
"""
import argparse
import pathlib
import random

ANIMALS = ["fox", "crow", "hare", "tortoise", "lion", "mouse", "wolf", "lamb", "ant", "grasshopper",
           "owl", "goat", "frog", "heron", "bear", "bee", "dove", "stag", "cat", "dog", "horse", "donkey",
           "eagle", "sparrow", "otter", "badger", "swan", "rooster", "pig", "deer"]
NAMES = ["Ada", "Bram", "Cora", "Dov", "Edda", "Finn", "Greta", "Hugo", "Ivo", "Juna", "Kai", "Lene",
         "Mira", "Nils", "Odo", "Pia", "Rolf", "Sina", "Tove", "Ulla"]
ADJ = ["old", "young", "clever", "proud", "hungry", "tired", "small", "brave", "greedy", "patient",
       "foolish", "kind", "quiet", "swift", "slow", "gentle", "stubborn", "curious", "wise", "lonely"]
PLACES = ["the river", "the forest", "the hill", "the meadow", "the old mill", "the well", "the orchard",
          "the marsh", "the barn", "the road to town", "the edge of the wood", "the frozen lake",
          "the garden wall", "the cave", "the wheat field"]
THINGS = ["a piece of cheese", "a bunch of grapes", "a golden seed", "a shiny stone", "a loaf of bread",
          "a jar of honey", "an apple", "a feather", "a bone", "a basket of figs", "a silver bell",
          "a warm blanket", "a map", "a key", "a lantern"]
TIMES = ["One morning", "Long ago", "On a cold night", "At the end of summer", "One windy day",
         "In the spring", "Early one autumn", "When the snow came", "At noon", "Once upon a time"]
FEELINGS = ["happy", "sad", "angry", "afraid", "ashamed", "surprised", "grateful", "jealous", "calm"]
MORALS = [
    "Slow and steady wins the race.", "Do not count your chickens before they hatch.",
    "Pride comes before a fall.", "A friend in need is a friend indeed.", "Look before you leap.",
    "Little by little does the trick.", "Do not trust flatterers.", "Kindness is never wasted.",
    "Greed often loses what it has.", "It is easy to despise what you cannot get.",
    "Work today and you will eat tomorrow.", "Appearances are often deceiving.",
    "The wise plan ahead.", "United we stand, divided we fall.", "Honesty is the best policy.",
    "Necessity is the mother of invention.", "Better safe than sorry.",
]
SAY = ["said", "asked", "cried", "whispered", "shouted", "laughed", "sighed", "replied"]


def a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def character(rng: random.Random):
    animal = rng.choice(ANIMALS)
    return {"animal": animal, "adj": rng.choice(ADJ), "name": rng.choice(NAMES)}


def quote(rng, speaker, text):
    verb = rng.choice(SAY)
    if rng.random() < 0.5:
        inner = text[:-1] + "," if text.endswith(".") else text    # "I am here," said the fox.
        return f'"{inner}" {verb} the {speaker["animal"]}.'
    return f'The {speaker["animal"]} {verb}, "{text}"'


def fable(rng: random.Random, number: int) -> str:
    x, y = character(rng), character(rng)
    while y["animal"] == x["animal"]:
        y = character(rng)
    place, thing, other_place = rng.choice(PLACES), rng.choice(THINGS), rng.choice(PLACES)
    title = f"{number}. THE {x['animal'].upper()} AND THE {y['animal'].upper()}"
    s = [f"{rng.choice(TIMES)}, {a(x['adj'])} {x['animal']} named {x['name']} walked down to {place}."]
    s.append(rng.choice([
        f"There it found {thing} lying in the grass.",
        f"It was looking for {thing}, for it had eaten nothing since the day before.",
        f"It carried {thing} and was very {rng.choice(FEELINGS)}.",
    ]))
    s.append(f"Soon {a(y['adj'])} {y['animal']} came by and saw it.")
    s.append(quote(rng, y, rng.choice([
        f"Good day, friend {x['animal']}. Where did you get {thing}?",
        f"What a fine {x['animal']} you are! Will you share {thing} with me?",
        f"Why do you walk so far from {other_place}?",
        "I have never seen anyone so clever as you.",
    ])))
    s.append(quote(rng, x, rng.choice([
        f"I found it near {place}, and it is mine.",
        "Go away, I have no time for you.",
        f"If you help me carry it to {other_place}, we can share it.",
        "Thank you, you are very kind.",
    ])))
    n_events = rng.randint(1, 3)
    for _ in range(n_events):
        s.append(rng.choice([
            f"The {y['animal']} waited until the {x['animal']} fell asleep.",
            f"So the two of them walked together to {other_place}.",
            f"But the {x['animal']} was {rng.choice(ADJ)} and did not listen.",
            f"Then the wind began to blow, and {thing} rolled away into {rng.choice(PLACES)}.",
            f"The {y['animal']} laughed and ran off as fast as it could.",
            f"All day the {x['animal']} worked, while the {y['animal']} sang in the sun.",
            f"The {x['animal']} opened its mouth to speak, and {thing} fell to the ground.",
            f"At {other_place} they met {a(rng.choice(ADJ))} {rng.choice(ANIMALS)} who gave them advice.",
        ]))
    s.append(rng.choice([
        f"In the end the {x['animal']} was {rng.choice(FEELINGS)}, and the {y['animal']} was {rng.choice(FEELINGS)}.",
        f"When winter came, the {y['animal']} had nothing, and the {x['animal']} had {thing}.",
        f"And so the {y['animal']} went home with {thing}, and the {x['animal']} went home with nothing.",
        f"From that day on, the {x['animal']} and the {y['animal']} were friends.",
    ]))
    body = " ".join(s)
    # wrap at ~76 columns like an old printed book
    lines, line = [], ""
    for word in body.split():
        if len(line) + len(word) + 1 > 76:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return f"{title}\n\n" + "\n".join(lines) + f"\n\nMoral: {rng.choice(MORALS)}\n\n"


def make(size: int, seed: int = 1234) -> str:
    rng = random.Random(seed)
    parts, total, n = [], 0, 1
    while total < size:
        parts.append(fable(rng, n))
        total += len(parts[-1])
        n += 1
    return "".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=200_000, help="characters (default 200000)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).with_name("fables.txt")))
    args = ap.parse_args()
    text = make(args.size, args.seed)
    pathlib.Path(args.out).write_text(text)
    print(f"wrote {len(text)} characters to {args.out}")


if __name__ == "__main__":
    main()

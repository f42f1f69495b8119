"""Synthetic writing and role-play prompts for self-distillation, made offline from templates.

The drafter is weakest on open-ended writing: on the corpus's own held-out ShareGPT answers it reaches a
rollout-order τ of 1.99 at T = 0, on MT-bench's first turns (writing and role-play) 1.55 (session 33). ShareGPT is
mostly questions and code; emails, blog posts, stories, poems, speeches and "act as ..." conversations are a small
part of it, and every usable ShareGPT first turn is already in the corpus. As with the maths prompts, a prompt only
has to draw out the target's register — the labels are the target's own answers — so each template below combines
a genre with seeded random topics, audiences, tones and length limits. The pool is finite and seeded, every prompt
id names its template and draw, and `dspark data prompts --exclude` still drops anything that shares content with
an evaluation set.
"""

import random
import string
from collections.abc import Callable, Iterator

from dspark.train.data import Prompt

TOPICS = (
    "learning to bake sourdough bread", "a week of cycling along the Danube", "starting a community garden",
    "working from home with young children", "choosing a first electric car", "a small-town farmers' market",
    "adopting a senior rescue dog", "the history of tea in Britain", "cutting the weekly grocery bill",
    "a night of stargazing in the desert", "learning a second language as an adult", "minimalist living",
    "a winter camping trip in Norway", "the benefits of morning walks", "running a first half-marathon",
    "restoring an old wooden boat", "the rise of board-game cafés", "visiting the temples of Kyoto",
    "composting in a city apartment", "teaching kids to code", "a road trip across Patagonia",
    "the joy of reading paper books", "urban beekeeping", "planning a budget wedding", "volunteering at a shelter",
    "keeping houseplants alive", "the first year of running a bakery", "digital detox weekends",
    "a food tour of Mexico City", "building a home library", "birdwatching for beginners", "learning to paint",
    "the science of good sleep", "moving to a new city alone", "the comeback of vinyl records",
    "hosting a dinner party on a budget", "a cooking class in Tuscany", "caring for aging parents",
    "public transport in European cities", "taking up rock climbing", "the art of handwritten letters",
    "saving for retirement in your twenties", "a rainy week in Edinburgh", "volunteering abroad",
    "the history of the bicycle", "growing tomatoes on a balcony", "a museum night in Amsterdam",
    "the pros and cons of open-plan offices", "making friends after university", "a family trip to Iceland",
)
PRODUCTS = (
    "a solar-powered phone charger", "noise-cancelling earbuds", "a smart water bottle that tracks how much you drink",
    "an ergonomic office chair", "a reusable notebook", "a language-learning app", "a quiet robot vacuum",
    "a foldable electric scooter", "a handmade ceramic mug", "a subscription box of healthy snacks",
    "a weatherproof hiking backpack", "a compact espresso maker", "a standing desk converter", "an herbal tea blend",
    "a children's picture book about the ocean", "a budgeting spreadsheet template", "a bamboo toothbrush",
    "a meal-planning app", "a wireless mechanical keyboard", "a set of resistance bands",
)
TONES = ("friendly", "formal", "humorous", "enthusiastic", "calm and reassuring", "persuasive", "warm", "concise")
LENGTHS = ("", "", " in about 100 words", " in under 150 words", " in three paragraphs", " in one paragraph",
           " in about 200 words", " in five sentences")
RECIPIENTS = ("your landlord", "a hiring manager", "your team", "a long-time customer", "your neighbour",
              "a university professor", "a conference organiser", "your manager", "a local newspaper editor",
              "the parents of your students")
EMAIL_PURPOSES = (
    "asking for a one-week extension on a project deadline", "requesting a meeting to discuss next year's budget",
    "apologising for a delayed delivery", "inviting them to a product launch", "following up after a job interview",
    "proposing a new meeting schedule", "reporting a broken heating system", "thanking them for a recommendation",
    "announcing a change in opening hours", "asking for feedback on a presentation you gave",
    "declining an invitation politely", "introducing a new colleague", "requesting a day off next Friday",
    "explaining a mistake in last month's invoice",
)
STORY_SEEDS = (
    "a lighthouse keeper who finds a message in a bottle", "a young inventor whose robot runs away",
    "a detective who can hear when people lie", "two rivals stuck in a broken-down train",
    "a chef who suddenly loses their sense of taste", "a girl who finds a door in the middle of a forest",
    "an astronaut who receives a call from home that should be impossible", "a retired teacher who solves one last "
    "mystery", "a village where it has not rained for ten years", "a street musician with a magical violin",
    "a boy who can talk to birds", "a librarian guarding a book nobody is allowed to read",
    "a dragon who is afraid of fire", "a time traveller stuck in the year 1850", "the last day of summer camp",
    "a clockmaker whose clocks all stop at the same minute", "a fisherman who catches a golden key",
    "an old map found inside a second-hand coat",
)
PLACES = ("a harbour at dawn", "a crowded train station at rush hour", "a quiet library on a snowy evening",
          "a fishing pier in a coastal town", "a mountain village during a festival", "a forest after heavy rain",
          "a busy hospital corridor", "a bakery early in the morning", "an abandoned amusement park",
          "a desert road at noon", "a school playground at recess", "a concert hall before the show begins")
POEM_FORMS = ("poem", "haiku", "limerick", "sonnet", "free-verse poem", "short rhyming poem")
POEM_SUBJECTS = ("autumn leaves", "the sea at night", "a grandmother's kitchen", "the first snow", "friendship",
                 "a city waking up", "an old bicycle", "the moon", "homesickness", "a summer storm", "coffee",
                 "a lost umbrella", "the sound of rain", "growing older", "a cat asleep in the sun")
OCCASIONS = ("a best friend's wedding", "a retirement party for a colleague", "a high-school graduation",
             "the opening of a community centre", "a team's end-of-season dinner", "a charity fundraiser",
             "welcoming new employees", "a grandparent's ninetieth birthday", "an award ceremony for volunteers")
REVIEWED = ("a new Italian restaurant in town", "a science-fiction novel you just finished", "a budget hotel",
            "a documentary about climate change", "a local theatre production", "a pair of running shoes",
            "a mobile puzzle game", "a weekend cooking course", "a museum exhibition about ancient Egypt")
ANNOUNCEMENTS = ("the opening of a new coffee shop", "a free coding workshop for teenagers",
                 "a charity run next month", "a new line of handmade candles", "a book club's first meeting",
                 "a company's tenth anniversary", "a summer sale at a bookstore", "a neighbourhood clean-up day")
TRAITS = ("collects forgotten keys", "never tells the same story twice", "speaks only in questions",
          "is afraid of silence", "paints portraits of strangers", "repairs broken clocks for free",
          "has lived in every country in Europe", "remembers every dream", "is the oldest postman in the city")
CONCEPTS = ("how vaccines train the immune system", "compound interest", "why the sky is blue", "inflation",
            "how a search engine works", "photosynthesis", "what a blockchain is", "how airplanes stay in the air",
            "supply and demand", "how the internet sends data", "climate change", "how memory works in the brain",
            "what machine learning is", "the water cycle", "how a credit score works")
AUDIENCES = ("a ten-year-old", "a grandparent who has never used a computer", "a group of high-school students",
             "a busy executive", "someone with no science background", "a new employee")
ROLES = {
    "a personal fitness trainer": ("I want to get stronger but only have 30 minutes a day. Where do I start?",
                                   "Design a one-week beginner workout plan for me."),
    "a travel agent": ("I have ten days and a modest budget for a trip in South America. What do you suggest?",
                       "Plan a relaxing weekend break for a couple who love food."),
    "a museum tour guide": ("Welcome our group and tell us about the most famous painting in your museum.",
                            "Explain why this ancient vase is so important."),
    "a career counsellor": ("I am a nurse thinking about moving into software. What should I consider?",
                            "How do I prepare for my first job interview?"),
    "a nutritionist": ("What should a healthy breakfast look like for a student?",
                       "Suggest a weekly meal plan for someone who wants to eat less sugar."),
    "a pirate captain": ("Tell your crew why we must sail through the storm tonight.",
                         "Describe the greatest treasure you ever found."),
    "a medieval knight": ("Describe your preparations for a great tournament.",
                          "Explain to a young squire what honour means."),
    "a customer-support agent for an internet provider": ("My connection keeps dropping every evening. Help me.",
                                                           "I was charged twice this month. What happens now?"),
    "a history teacher": ("Explain the causes of the French Revolution to your class.",
                          "Tell us a story about daily life in ancient Rome."),
    "a startup founder pitching to investors": ("Pitch your app that connects neighbours who want to share tools.",
                                                "Explain why now is the right time for your product."),
    "a detective in 1920s Chicago": ("Describe the scene of the crime you were just called to.",
                                     "Interrogate a nervous witness about a missing necklace."),
    "a wise old wizard": ("Give advice to a young apprentice who fears failure.",
                          "Explain the first rule of magic to a curious child."),
    "a sports commentator": ("Commentate the last minute of a tied football final.",
                             "Describe a record-breaking marathon finish."),
    "a financial advisor": ("I just got my first salary. How should I manage it?",
                            "Explain to me whether I should rent or buy a home."),
    "a film critic": ("Review a summer blockbuster about a heist on the Moon.",
                      "Explain what makes a great opening scene."),
    "a friendly robot from the year 3000": ("Describe what school is like in your time.",
                                            "Tell me what humans of the past got wrong about the future."),
    "a park ranger": ("Give a safety briefing to hikers before a mountain trail.",
                      "Tell visitors about the animals living in the park."),
    "a language tutor": ("Help me practise ordering food in a restaurant in Spanish.",
                         "Explain the difference between formal and informal speech."),
}
#: requests any of the roles can answer, beside each role's own
ANY_ROLE = ("Introduce yourself and describe a typical day.", "What mistake do beginners make most often?",
            "Give me your three best pieces of advice.", "Tell me about the hardest day of your career.")
ROLE_OPENERS = ("Act as {role}. ", "I want you to act as {role}. ", "Pretend you are {role}. ",
                "Imagine you are {role}. ", "You are {role}. ")
VIEWPOINTS = ("a park bench", "a lost sock", "the last bookshop in a small town",
              "a weather satellite", "a stray cat", "a lighthouse", "a library book that has never been borrowed",
              "a river flowing to the sea", "a snowman on the first warm day", "a retired racing car")
CLEAN_SENTENCES = (
    "I went to the store yesterday because we ran out of milk, and I bought some bread too.",
    "Their house is bigger than ours, but it is too far from the station.",
    "She doesn't know when the film starts, so she thinks they are going to be late.",
    "We were planning to leave early, but the weather was too bad to drive.",
    "The team has finished its report, and it will be sent to the manager tomorrow.",
    "He could have taken the bus, but he decided to walk there instead.",
    "Each of the students has their own locker, which they must keep tidy.",
    "If I were you, I would accept the offer before the deadline passes.",
)
MISTAKES = {"went": "goed", "because": "becuase", "bought": "buyed", "Their": "There", "than": "then",
            "too": "to", "doesn't": "don't", "they are": "there", "were": "was", "its": "it's", "will be": "will",
            "could have": "could of", "decided": "decide", "has": "have", "their": "they're", "were you": "was you",
            "before": "befor", "finished": "finish"}
REWRITE_STYLES = ("more formal", "friendlier", "more concise", "more persuasive", "suitable for a children's book",
                  "more polite")


#: the choices each {slot} of a form below is filled from, in the slot's order of appearance
SLOTS = {
    "tone": TONES, "topic": TOPICS, "length": LENGTHS, "product": PRODUCTS, "recipient": RECIPIENTS,
    "purpose": EMAIL_PURPOSES, "story_seed": STORY_SEEDS, "place": PLACES, "poem_form": POEM_FORMS,
    "poem_subject": POEM_SUBJECTS, "occasion": OCCASIONS, "reviewed": REVIEWED, "announcement": ANNOUNCEMENTS,
    "trait": TRAITS, "concept": CONCEPTS, "audience": AUDIENCES, "viewpoint": VIEWPOINTS,
    "rewrite_style": REWRITE_STYLES, "sentence": CLEAN_SENTENCES,
    "blog_verb": ("Write", "Compose", "Draft"),
    "email_close": ("", " Keep it short.", " Use a clear subject line.", " End with a call to action."),
    "story_kind": ("a short story", "the opening paragraph of a story", "a bedtime story", "a one-page story"),
    "description_close": ("", ", in the present tense", ", in about 150 words"),
    "review_kind": ("balanced", "glowing", "critical", "funny"),
    "post_kind": ("a social media post", "a short newsletter item", "a tweet-length post", "a flyer"),
    "character_close": ("", ", in one paragraph", ", in about 120 words"),
    "viewpoint_request": ("Describe an ordinary day in your life.", "How do you feel about the people around you?",
                          "Tell the story of the most surprising thing that ever happened to you."),
}
FORMS = {
    "blog_post": "{blog_verb} a {tone} blog post about {topic}{length}.",
    "email": "Write a {tone} email to {recipient} {purpose}.{email_close}",
    "story": "Write {story_kind} about {story_seed}{length}.",
    "poem": "Write a {poem_form} about {poem_subject}.",
    "description": "Describe {place} so that the reader can almost see and hear it{description_close}.",
    "product": "Write a {tone} product description for {product}{length}.",
    "speech": "Write a short {tone} speech for {occasion}.",
    "review": "Write a {review_kind} review of {reviewed}.",
    "social_post": "Write {post_kind} announcing {announcement}.",
    "character": "Describe a memorable character who {trait}, using vivid imagery{character_close}.",
    "explain": "Explain {concept} to {audience} in simple terms.",
    "viewpoint": "Imagine you are {viewpoint}. {viewpoint_request}",
    "rewrite": 'Rewrite this sentence to make it {rewrite_style}: "{sentence}"',
}

Template = Callable[[random.Random], str]


def filled(form: str) -> Template:
    """The template that fills `form`'s slots from SLOTS, one seeded choice each, left to right."""
    names = [name for _, name, _, _ in string.Formatter().parse(form) if name]

    def fill(rng: random.Random) -> str:
        return form.format(**{name: rng.choice(SLOTS[name]) for name in names})

    return fill


def outline(rng):
    return (f"Create an outline for an article about {rng.choice(TOPICS)}, with a title, section headings and "
            f"{rng.randint(2, 4)} key points under each heading.")


def headlines(rng):
    return f"Suggest {rng.randint(3, 6)} titles for an article about {rng.choice(TOPICS)}."


def role_play(rng):
    role = rng.choice(tuple(ROLES))
    return rng.choice(ROLE_OPENERS).format(role=role) + rng.choice(ROLES[role] + ANY_ROLE)


def proofread(rng):
    sentences = rng.sample(CLEAN_SENTENCES, 2)
    text = " ".join(sentences)
    wrong = [(right, bad) for right, bad in MISTAKES.items() if right in text]
    for right, bad in rng.sample(wrong, min(len(wrong), rng.randint(2, 4))):
        text = text.replace(right, bad, 1)
    return f"Proofread this text and fix the mistakes:\n{text}"


_CUSTOM = {f.__name__: f for f in (outline, headlines, role_play, proofread)}
#: every template, in the order the pool interleaves them
TEMPLATES: dict[str, Template] = {name: _CUSTOM[name] if name in _CUSTOM else filled(FORMS[name]) for name in (
    "blog_post", "outline", "email", "story", "poem", "description", "product", "speech", "review", "social_post",
    "character", "headlines", "explain", "role_play", "viewpoint", "proofread", "rewrite",
)}


def writing_prompts(seed: int = 0, per_template: int = 300) -> Iterator[Prompt]:
    """A finite, seeded pool of writing and role-play prompts, templates interleaved (some draws repeat a text:
    `dspark data prompts` drops the duplicates). Ids are `writing/<template>/<seed>.<draw>`."""
    rng = random.Random(seed)
    draws = [(name, draw) for draw in range(per_template) for name in TEMPLATES]
    rng.shuffle(draws)
    for name, draw in draws:
        text = TEMPLATES[name](random.Random(f"{seed}/{name}/{draw}"))
        yield Prompt(f"writing/{name}/{seed}.{draw}", "writing", [{"role": "user", "content": text}])

"""The cells of synthetic tables: what a column's values look like, by its name and type, and the words drawn.

A number column holds years (by its name) or counts; a text column holds names, places, teams, dates, scores,
numbers or words, by keywords of its name (:data:`_TEXT_MAKERS`), so a question's condition values read like
WikiSQL's. :mod:`textsql.data.synthetic` draws every cell through :func:`cell_maker` with its seeded generator.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

logger = logging.getLogger(__name__)

_FIRST_NAMES = [
    "James",
    "Maria",
    "Robert",
    "Linda",
    "Michael",
    "Sarah",
    "David",
    "Karen",
    "Thomas",
    "Nancy",
    "Daniel",
    "Lisa",
    "Paul",
    "Helen",
    "Mark",
    "Laura",
    "Steven",
    "Anna",
    "Kevin",
    "Emma",
    "Brian",
    "Julia",
    "George",
    "Rosa",
    "Edward",
    "Ingrid",
    "Ronald",
    "Olga",
    "Jason",
    "Fatima",
    "Gary",
    "Yuki",
    "Eric",
    "Chen",
    "Peter",
    "Amara",
    "Henry",
    "Sofia",
    "Victor",
    "Nadia",
    "Oscar",
    "Elena",
    "Ivan",
    "Priya",
    "Hugo",
    "Leila",
    "Pablo",
    "Mei",
    "Dmitri",
    "Aisha",
    "Lars",
    "Chiara",
    "Tomas",
    "Kofi",
    "Greta",
    "Rafael",
    "Hana",
    "Stefan",
    "Imani",
    "Felix",
]
_LAST_NAMES = [
    "Smith",
    "Garcia",
    "Novak",
    "Johnson",
    "Müller",
    "Rossi",
    "Kowalski",
    "Tanaka",
    "Okafor",
    "Silva",
    "Jensen",
    "Dubois",
    "Ivanov",
    "Brown",
    "Nguyen",
    "Larsen",
    "Costa",
    "Schmidt",
    "Moreau",
    "Kim",
    "Patel",
    "Walsh",
    "Fischer",
    "Romano",
    "Berg",
    "Lopez",
    "Adeyemi",
    "Sato",
    "Horvat",
    "Keller",
    "Murphy",
    "Lindqvist",
    "Petrov",
    "Santos",
    "Wagner",
    "Hughes",
    "Ferrari",
    "Nakamura",
    "Mensah",
    "Bauer",
    "Clarke",
    "Duarte",
    "Vogel",
    "Haddad",
    "Quinn",
    "Olsen",
    "Russo",
    "Kaplan",
    "Ortiz",
    "Fleming",
    "Barros",
    "Ward",
    "Stone",
    "Hale",
    "Price",
    "Doyle",
    "Marsh",
    "Brandt",
    "Coleman",
    "Reyes",
]
_PLACES = [
    "Austin",
    "Berlin",
    "Cairo",
    "Denver",
    "Lagos",
    "Lyon",
    "Madrid",
    "Oslo",
    "Perth",
    "Quebec",
    "Seoul",
    "Turin",
    "Utrecht",
    "Valencia",
    "Warsaw",
    "Zagreb",
    "Boston",
    "Dublin",
    "Geneva",
    "Hamburg",
    "Kyoto",
    "Lima",
    "Milan",
    "Nairobi",
    "Osaka",
    "Porto",
    "Riga",
    "Sydney",
    "Tampa",
    "Vienna",
    "Leeds",
    "Bergen",
    "Calgary",
    "Dallas",
    "Glasgow",
    "Houston",
    "Leipzig",
    "Malmo",
    "Naples",
    "Ottawa",
    "Phoenix",
    "Seville",
    "Toledo",
    "Uppsala",
    "Winnipeg",
    "Bilbao",
    "Cork",
    "Graz",
    "Hanover",
    "Kansas",
    "Lisbon",
    "Munich",
    "Nantes",
    "Orlando",
    "Pisa",
    "Reno",
    "Salzburg",
    "Tucson",
    "Verona",
]
_PLACE_SUFFIXES = ("", "", "", " City", " North", " State", " Park")
_WORDS = [
    "Red",
    "Blue",
    "Silver",
    "Golden",
    "Green",
    "Black",
    "White",
    "Royal",
    "Grand",
    "Little",
    "Old",
    "New",
    "Northern",
    "Southern",
    "Eastern",
    "Western",
    "Iron",
    "Crystal",
    "Stone",
    "River",
    "Forest",
    "Ocean",
    "Star",
    "Moon",
    "Sun",
    "Eagle",
    "Lion",
    "Wolf",
    "Falcon",
    "Tiger",
    "Bear",
    "Fox",
    "Hawk",
    "Storm",
    "Thunder",
    "Fire",
    "Ice",
    "Shadow",
    "Light",
    "Dream",
    "Harbor",
    "Valley",
    "Bridge",
    "Tower",
    "Garden",
    "Island",
    "Mountain",
    "Summer",
    "Winter",
    "Spring",
    "Autumn",
    "Night",
    "Morning",
    "Echo",
    "Spirit",
    "Crown",
    "Arrow",
    "Anchor",
    "Beacon",
    "Canyon",
    "Comet",
    "Delta",
    "Ember",
    "Frontier",
]
_TEAM_NOUNS = ("United", "Rovers", "Eagles", "Tigers", "Wanderers", "Athletic", "Stars", "Hawks", "Rangers", "FC")
_MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
_CODE_LETTERS = "ABCDEFGHJKLMNPRSTVWXZ"


def cell_maker(name: str, kind: str) -> Callable[[random.Random], str | int]:
    """What a cell of a column looks like, from the column's name and type: a function of the generator's
    :class:`random.Random` that draws one.

    :param name: the column's name, as its header writes it.
    :param kind: its type, ``real`` or ``text``.
    :rtype: collections.abc.Callable
    """
    lowered = name.lower()
    if kind == "real":
        if "year" in lowered or "season" in lowered:
            return lambda rng: rng.randint(1950, 2015)
        return lambda rng: rng.randint(1, 400)
    for keywords, maker in _TEXT_MAKERS:
        if any(keyword in lowered for keyword in keywords):
            return maker
    return _words


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}"


def _place(rng: random.Random) -> str:
    return rng.choice(_PLACES) + rng.choice(_PLACE_SUFFIXES)


def _team(rng: random.Random) -> str:
    return f"{rng.choice(_PLACES)} {rng.choice(_TEAM_NOUNS)}"


def _date(rng: random.Random) -> str:
    month, day, year = rng.choice(_MONTHS), rng.randint(1, 28), rng.randint(1950, 2015)
    return f"{month} {day}, {year}" if rng.random() < 0.5 else f"{day} {month} {year}"


def _score(rng: random.Random) -> str:
    return f"{rng.choice('WL')} {rng.randint(0, 40)}-{rng.randint(0, 40)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1, 400))


def _year(rng: random.Random) -> str:
    return str(rng.randint(1950, 2015))


def _words(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return f"{rng.choice(_CODE_LETTERS)}{rng.choice(_CODE_LETTERS)}-{rng.randint(10, 999)}"
    return " ".join(rng.sample(_WORDS, rng.randint(1, 2)))


# Cell values of text columns by keywords of the column's name; any other text column gets _words.
_TEXT_MAKERS: tuple[tuple[tuple[str, ...], Callable[[random.Random], str]], ...] = (
    (("date", "born", "birth"), _date),
    (("year", "season"), _year),
    (
        ("no.", "#", "number", "pick", "round", "rank", "total", "points", "population", "viewers", "age", "goals"),
        _number,
    ),
    (("score", "result", "record"), _score),
    (("team", "club", "opponent", "constructor", "franchise", "home", "away"), _team),
    (
        (
            "player",
            "name",
            "driver",
            "director",
            "directed",
            "written",
            "winner",
            "coach",
            "artist",
            "candidate",
            "incumbent",
            "rider",
            "captain",
            "author",
            "actor",
            "manager",
            "champion",
            "host",
            "pilot",
            "writer",
        ),
        _person,
    ),
    (
        (
            "location",
            "venue",
            "city",
            "country",
            "nationality",
            "state",
            "circuit",
            "college",
            "school",
            "hometown",
            "region",
            "province",
            "capital",
            "district",
            "county",
            "stadium",
            "town",
        ),
        _place,
    ),
)

"""Pydantic models and prompts for the structured-outputs client suite.

``Ticket`` and ``Person`` are the extractions a client first reported (the server then added
properties the schema never named); the rest cover nested models, enums and literals, optional
fields, bounded lists, patterns, unions, and ``additionalProperties`` given explicitly (a model
that allows extra fields, a ``dict`` field). ``bounded``: every string and array has a bound,
so a whole reply fits in ``structured_clients.MAX_TOKENS``; ``open``: the schema itself allows
properties it does not name. Needs pydantic (the ``test`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Short = Annotated[str, Field(max_length=30)]
Line = Annotated[str, Field(max_length=60)]


class Ticket(BaseModel):
    title: str = Field(max_length=60)
    priority: Literal["low", "medium", "high"]
    tags: list[str] = Field(max_length=4)


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)
    city: str = Field(max_length=40)


class Address(BaseModel):
    street: Line
    city: Short
    postal_code: str = Field(pattern=r"^[0-9]{5}$")


class Contact(BaseModel):
    name: Short
    email: str = Field(pattern=r"^[a-z0-9.]{1,20}@[a-z0-9]{1,15}\.[a-z]{2,3}$")
    address: Address


class Ingredient(BaseModel):
    name: Short
    quantity: Short


class Recipe(BaseModel):
    title: Line
    servings: int = Field(ge=1, le=20)
    ingredients: list[Ingredient] = Field(max_length=5)


class Meeting(BaseModel):
    topic: Line
    day: Literal["monday", "tuesday", "wednesday", "thursday", "friday"]
    start_hour: int = Field(ge=0, le=23)
    attendees: list[Short] = Field(max_length=5)


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence: int = Field(ge=0, le=100)


class Genre(str, Enum):
    fantasy = "fantasy"
    mystery = "mystery"
    science_fiction = "science fiction"
    romance = "romance"
    history = "history"


class Book(BaseModel):
    title: Line
    author: Short
    year: int = Field(ge=1000, le=2100)
    genres: list[Genre] = Field(max_length=3)


class Flight(BaseModel):
    origin: str = Field(pattern=r"^[A-Z]{3}$")
    destination: str = Field(pattern=r"^[A-Z]{3}$")
    date: str = Field(pattern=r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]$")
    passengers: int = Field(ge=1, le=9)


class Company(BaseModel):
    name: Short
    vat_number: str | None = Field(default=None, max_length=15)


class InvoiceLine(BaseModel):
    item: Short
    quantity: int = Field(ge=1, le=999)
    unit_price_cents: int = Field(ge=0, le=10_000_000)


class Invoice(BaseModel):
    number: str = Field(max_length=20)
    customer: Company
    lines: list[InvoiceLine] = Field(max_length=3)


class Condition(str, Enum):
    sunny = "sunny"
    cloudy = "cloudy"
    rainy = "rainy"
    snowy = "snowy"


class Weather(BaseModel):
    city: Short
    temperature_c: int = Field(ge=-60, le=60)
    condition: Condition
    wind_kmh: int | None = Field(default=None, ge=0, le=300)


class Movie(BaseModel):
    title: Line
    year: int = Field(ge=1880, le=2100)
    rating: int = Field(ge=0, le=10)
    cast: list[Short] = Field(max_length=3)


class Todo(BaseModel):
    title: str = Field(max_length=40)
    done: bool
    priority: int = Field(ge=1, le=3)


class TodoList(BaseModel):
    items: list[Todo] = Field(max_length=4)


class Employee(BaseModel):
    name: Short
    department: Literal["engineering", "sales", "finance", "support"]
    manager: str | None = Field(default=None, max_length=30)
    skills: list[str] = Field(max_length=4)


class Place(BaseModel):
    city: Short
    country: Short


class Event(BaseModel):
    name: Line
    place: Place
    online: bool


class BugReport(BaseModel):
    component: Literal["login", "search", "checkout", "profile"]
    severity: Literal["minor", "major", "critical"]
    steps: list[Line] = Field(max_length=3)
    expected: str = Field(max_length=80)
    actual: str = Field(max_length=80)


class Nutrition(BaseModel):
    food: Short
    calories: int = Field(ge=0, le=2000)
    protein_grams: int = Field(ge=0, le=200)
    vegan: bool


class Car(BaseModel):
    make: Short
    model: Short
    year: int = Field(ge=1900, le=2100)
    color: Literal["black", "white", "red", "blue", "silver"] | None = None


class Feedback(BaseModel):
    rating: int = Field(ge=1, le=5)
    liked: list[Short] = Field(max_length=3)
    would_recommend: bool
    comment: str | None = Field(default=None, max_length=120)


class Circle(BaseModel):
    kind: Literal["circle"]
    radius: int = Field(ge=1, le=100)


class Square(BaseModel):
    kind: Literal["square"]
    side: int = Field(ge=1, le=100)


class Drawing(BaseModel):
    title: Short
    shapes: list[Circle | Square] = Field(max_length=3)


class Settings(BaseModel):
    """Extra fields allowed: ``additionalProperties: true``."""

    model_config = ConfigDict(extra="allow")
    theme: Literal["light", "dark"]
    font_size: int = Field(ge=8, le=32)


class Scoreboard(BaseModel):
    """A ``dict`` field: ``additionalProperties`` is a schema, and the keys are the reply's."""

    game: Short
    scores: dict[str, int] = Field(max_length=4)


@dataclass(frozen=True)
class Case:
    """One extraction: a model, its prompt, and what its schema promises."""

    model: type[BaseModel]
    prompt: str
    bounded: bool = True
    open: bool = False

    @property
    def name(self) -> str:
        return self.model.__name__


CASES: list[Case] = [
    Case(Ticket, "Make a ticket: typo in the footer copyright year, fix whenever.", False),
    Case(Person, "Extract the person: Maria Lopez is a 34-year-old nurse who lives in Madrid."),
    Case(
        Contact,
        "Save this contact: Tom Baker, tom.baker@mail.com, 12 Oak Street, 90210 Springfield.",
    ),
    Case(Recipe, "Give me a simple pancake recipe for four people."),
    Case(Meeting, "Schedule the budget review on Tuesday at 10 with Anna and Luis."),
    Case(Sentiment, "Classify the sentiment: 'The delivery was late and the box was broken.'"),
    Case(Book, "Describe the book 'The Hobbit' by J.R.R. Tolkien, published in 1937."),
    Case(Flight, "Book a flight from Paris CDG to New York JFK on 2025-07-14 for 2 people."),
    Case(Invoice, "Invoice INV-042 for Acme Ltd: 3 chairs at 45 euros and 1 desk at 120 euros."),
    Case(Weather, "Report the weather: Oslo, minus 3 degrees, snowing, light wind."),
    Case(Movie, "Describe the movie Jaws from 1975 with a rating out of 10."),
    Case(TodoList, "Make a todo list for moving house."),
    Case(
        Employee,
        "Add an employee: Priya Nair, engineer, reports to Sam Wong, knows Python and SQL.",
        False,
    ),
    Case(Event, "Create an event: the Lisbon Jazz Night at the riverside in Lisbon, Portugal."),
    Case(BugReport, "File a bug: the search page shows nothing when I type an accent like é."),
    Case(Nutrition, "Give the nutrition facts of a banana."),
    Case(Car, "Register a car: a red 2018 Toyota Corolla."),
    Case(
        Feedback, "Turn this review into feedback: 'Great staff, tasty food, a bit noisy. 4 stars.'"
    ),
    Case(Drawing, "Describe a drawing called sun and box with one circle and one square."),
    Case(
        Settings, "Save my settings: dark theme, font size 14, and language English.", False, True
    ),
    Case(Scoreboard, "Record the chess club scores: Ana 3, Ben 2, Chloe 5.", False, True),
    Case(Company, "Register the company Nordwind GmbH with VAT number DE123456789."),
]


def case(name: str) -> Case:
    """The case of the model called ``name``."""
    return next(c for c in CASES if c.name == name)

"""Schemas and tools shared by the structured-output tests."""

import json

# nested objects, enums, integer bounds, arrays with minItems/maxItems, bounded strings
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "floor": {"type": "integer", "minimum": -2, "maximum": 40},
            },
            "required": ["city", "zip", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PERSON_JSON = json.dumps(PERSON)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}

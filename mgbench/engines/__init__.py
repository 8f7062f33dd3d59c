"""The engines a flips audit decodes through: the interface both implement (interface.py),
the in-process decode engine (inprocess/) and a served model seen as a black box (endpoint/).
A new engine is a new folder here."""

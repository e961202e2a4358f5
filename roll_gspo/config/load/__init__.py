"""Reading a config: the YAML loader, the generated key reference and the ROLL-YAML report."""

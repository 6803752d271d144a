"""Ray processes of one engine group: thin actor classes around cluster/ and cache/ objects."""

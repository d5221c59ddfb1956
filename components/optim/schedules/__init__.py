"""Learning-rate schedules as a registry family (``SCHEDULES``, ``schedule=cosine|linear|constant|wsd``)."""

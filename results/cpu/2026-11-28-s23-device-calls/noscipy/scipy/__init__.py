raise ImportError("scipy hidden for this measurement: the README install has none")

"""Analysis tools: profiles, compiled HLO, compile logs and run folders read and summarised."""

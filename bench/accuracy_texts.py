"""The fixed texts the quantization report scores every setting on (bench/quantization.py): English of several
kinds, none of it the KV cache's calibration text (neuron_serve/generation/precision/kv_cache.py)."""

TEXTS = (
    # Narrative
    "The lighthouse keeper had not seen a ship in eleven days. Each evening he climbed the spiral stairs, wound "
    "the clockwork that turned the great lens, and watched the beam sweep across an empty sea. On the twelfth "
    "night a small fishing boat appeared at the edge of the fog, its single lantern swinging as the waves lifted "
    "it. He raised the brass telescope and counted three figures on deck, one of them waving a red scarf.",
    # Explanation
    "Photosynthesis is the process by which green plants turn light into chemical energy. Chlorophyll in the "
    "leaves absorbs sunlight, mostly in the blue and red parts of the spectrum, and uses that energy to split "
    "water molecules. The oxygen is released into the air, while the hydrogen is combined with carbon dioxide to "
    "build sugars that the plant stores or burns for growth.",
    # Instructions
    "To replace a bicycle inner tube, first release the brake and remove the wheel from the frame. Let out any "
    "remaining air, then use two tyre levers to lift one side of the tyre over the rim. Pull the old tube out, "
    "check the inside of the tyre for thorns or glass, and fit the new tube starting at the valve. Inflate it "
    "slightly before pressing the tyre back onto the rim.",
    # Dialogue
    "\"Are you sure this is the right train?\" asked Maria, looking at the departure board.\n"
    "\"Platform four, eight fifteen to Lyon,\" said her brother. \"It says so right there.\"\n"
    "\"It also says it is delayed by forty minutes.\"\n"
    "\"Then we have time for coffee,\" he replied, already walking towards the kiosk.",
    # Code
    "def merge_sorted(left, right):\n"
    "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    result, i, j = [], 0, 0\n"
    "    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n"
    "            result.append(left[i])\n"
    "            i += 1\n"
    "        else:\n"
    "            result.append(right[j])\n"
    "            j += 1\n"
    "    return result + left[i:] + right[j:]\n",
    # History
    "The printing press, developed by Johannes Gutenberg around 1440, used movable metal type and an oil-based "
    "ink. Within fifty years presses were operating in more than two hundred cities across Europe, and millions "
    "of books had been printed. The spread of cheap printed material helped literacy grow and allowed new ideas "
    "in science and religion to travel faster than ever before.",
    # Numbers and facts
    "Mount Everest rises 8,849 metres above sea level, on the border between Nepal and China. The first confirmed "
    "ascent was made on 29 May 1953 by Edmund Hillary and Tenzing Norgay. Today several hundred climbers reach the "
    "summit in a good year, most of them in a short window of calm weather in late May.",
    # A chat exchange
    "User: Can you suggest a simple vegetarian dinner?\n"
    "Assistant: Sure. Try a chickpea curry: fry an onion with garlic and ginger, add curry powder, a tin of "
    "chopped tomatoes and a tin of chickpeas, then simmer for twenty minutes. Stir in a handful of spinach at the "
    "end and serve it with rice or flatbread.",
)

# The prompts whose greedy continuations are compared (the first sentence of each text).
PROMPTS = tuple(text.split(". ")[0].split("\n")[0] for text in TEXTS)

//! Unit tests of the workloads' schedules and ceilings.

use super::*;

fn tok_session(id: &str, start: f64, ids: Vec<u32>, uptos: &[usize]) -> Session {
    Session {
        id: id.into(),
        start_ms: start,
        content: Content::Tokens(ids),
        turns: uptos.iter().map(|&u| Turn { upto: u, think_ms: 10.0, max_tokens: 4 }).collect(),
        model: None,
    }
}

#[test]
fn names_round_trip_and_lists() {
    for k in WorkloadKind::ALL {
        assert_eq!(WorkloadKind::parse(k.name()), Ok(k));
    }
    assert!(WorkloadKind::parse("x").is_err());
    assert_eq!(
        WorkloadKind::parse_list("cold,trace"),
        Ok(vec![WorkloadKind::Cold, WorkloadKind::Trace])
    );
    assert!(WorkloadKind::parse_list("cold,cold").is_err());
    assert!(WorkloadKind::parse_list("").is_err());
    assert!(!WorkloadKind::Cold.has_sessions() && WorkloadKind::Trace.has_sessions());
}

#[test]
fn ceiling_table() {
    let a: Vec<u32> = (0..64).collect();
    let mut b = a.clone();
    b[40] = 999; // diverges in block 2 (of 16-token blocks)
    let cases: Vec<(&str, Vec<Session>, (u64, u64))> = vec![
        ("nothing", vec![], (0, 0)),
        ("one prompt is all misses", vec![tok_session("s", 0.0, a.clone(), &[64])], (0, 64)),
        // Turn 2 reuses turn 1's 32 tokens; its own last 32 are new.
        ("growing session", vec![tok_session("s", 0.0, a.clone(), &[32, 64])], (32, 96)),
        // The same prompt twice: the second is all hits.
        (
            "siblings",
            vec![tok_session("x", 0.0, a.clone(), &[64]), tok_session("y", 0.0, a.clone(), &[64])],
            (64, 128),
        ),
        // Shared 2 blocks, then different: the chain stops matching at the first difference.
        (
            "diverging",
            vec![tok_session("x", 0.0, a.clone(), &[64]), tok_session("y", 1.0, b, &[64])],
            (32, 128),
        ),
        // A partial last block counts its own length.
        (
            "partial block",
            vec![tok_session("x", 0.0, a.clone(), &[20]), tok_session("y", 1.0, a, &[20])],
            (20, 40),
        ),
    ];
    for (name, sessions, (reused, total)) in cases {
        let c = sessions_ceiling(&sessions, 16);
        assert_eq!((c.tokens_reused, c.tokens_total), (reused, total), "{name}");
    }
}

#[test]
fn chat_ceiling_counts_message_bytes_in_send_order() {
    let msgs = vec![
        ChatMsg::new("system", "S".repeat(100)),
        ChatMsg::new("user", "u1".into()),
        ChatMsg::new("assistant", "a1".into()),
        ChatMsg::new("user", "u2u2".into()),
    ];
    let s = Session {
        id: "c".into(),
        start_ms: 0.0,
        content: Content::Chat(msgs.clone()),
        turns: vec![
            Turn { upto: 2, think_ms: 0.0, max_tokens: 1 },
            Turn { upto: 4, think_ms: 5.0, max_tokens: 1 },
        ],
        model: None,
    };
    // Another conversation sharing only the system prompt, sent between the two turns.
    let mut other_msgs = msgs;
    other_msgs[1].content = "zz".into();
    let o = Session {
        id: "d".into(),
        start_ms: 1.0,
        content: Content::Chat(other_msgs),
        turns: vec![Turn { upto: 2, think_ms: 0.0, max_tokens: 1 }],
        model: None,
    };
    let c = sessions_ceiling(&[s.clone(), o], 16);
    // Prompts: [S,u1] (102 new), [S,zz] (100 reused), [S,u1,a1,u2u2] (102 reused of 108).
    assert_eq!((c.tokens_reused, c.tokens_total), (202, 102 + 102 + 108));
    let body = s.body(1, "m").unwrap();
    assert_eq!(body["messages"].as_array().unwrap().len(), 4);
    assert_eq!(body["ignore_eos"], json!(true));
    assert!(s.body(2, "m").is_none());
    assert_eq!(s.path(), "/v1/chat/completions");
    assert_eq!(s.scheduled_times_ms(), vec![0.0, 5.0]);
}

#[test]
fn fleet_lru_table() {
    // a and b: 64 tokens each, four 16-token blocks, nothing shared; then a again.
    let a: Vec<u32> = (0..64).collect();
    let b: Vec<u32> = (100..164).collect();
    let sessions = vec![
        tok_session("a", 0.0, a.clone(), &[64]),
        tok_session("b", 1.0, b, &[64]),
        tok_session("a2", 2.0, a, &[64]),
    ];
    let prompts = scheduled_prompts(&sessions, 16);
    let counted = || prompts.iter().map(|p| (p, true));
    let cases: [(&str, u64, u64); 5] = [
        // Everything fits: the ceiling's answer.
        ("unbounded", u64::MAX, 64),
        ("exactly both", 128, 64),
        // b pushes out a's tail first (a's head was used last): a again hits its first two blocks.
        ("tail evicted first", 96, 32),
        // b evicts all of a.
        ("one prompt fits", 64, 0),
        ("no cache", 0, 0),
    ];
    for (name, capacity, reused) in cases {
        let c = fleet_lru(counted(), capacity);
        assert_eq!((c.requests, c.tokens_total, c.tokens_reused), (3, 192, reused), "{name}");
    }
    assert_eq!(
        fleet_lru(counted(), u64::MAX),
        sessions_ceiling(&sessions, 16),
        "unbounded = the ceiling"
    );
    // A head evicted while its tail stays: the prompt hits nothing (engines match leading
    // blocks). [1, 2]; [2] alone (2 is now newer than 1); [9] evicts 1; [1, 2] again.
    let synthetic: Vec<Segments> =
        vec![vec![(1, 16), (2, 16)], vec![(2, 16)], vec![(9, 16)], vec![(1, 16), (2, 16)]];
    let c = fleet_lru(synthetic.iter().map(|p| (p, true)), 32);
    assert_eq!(c.tokens_reused, 16, "only [2] hits");
    // History is used but not counted.
    let c = fleet_lru(prompts.iter().enumerate().map(|(i, p)| (p, i == 2)), 96);
    assert_eq!((c.requests, c.tokens_total, c.tokens_reused), (1, 64, 32));
}

#[test]
fn ceiling_with_history_table() {
    // One conversation growing 32 → 64 tokens (two 16-token blocks a turn), another sharing
    // its first block only.
    let a: Vec<u32> = (0..64).collect();
    let mut b = a.clone();
    b[20] = 999;
    let sessions =
        vec![tok_session("a", 0.0, a.clone(), &[32, 64]), tok_session("b", 0.0, b, &[32])];
    let p = |session: &'static str, turn: usize, sent_ms: f64, counted: bool| SentPrompt {
        session,
        turn,
        sent_ms,
        counted,
    };
    type Case = (&'static str, Vec<SentPrompt<'static>>, (u64, u64, u64), usize);
    let cases: Vec<Case> = vec![
        ("nothing sent", vec![], (0, 0, 0), 0),
        // Everything counted, send order: a0 (32 new), b0 (16 reused of 32), a1 (32 reused of 64).
        (
            "no warm-up",
            vec![p("a", 0, 0.0, true), p("b", 0, 1.0, true), p("a", 1, 2.0, true)],
            (3, 48, 128),
            0,
        ),
        // a0 in the warm-up: history only; the window's a1 reuses it, b0 reuses block 0.
        (
            "warm-up is history",
            vec![p("a", 0, 0.0, false), p("b", 0, 1.0, true), p("a", 1, 2.0, true)],
            (2, 48, 96),
            0,
        ),
        // Order is send time, not the slice's order.
        ("sorted by send time", vec![p("a", 1, 2.0, true), p("a", 0, 0.0, false)], (1, 32, 64), 0),
        // A turn never sent is no history: a1 alone reuses nothing.
        ("cut turn is not history", vec![p("a", 1, 2.0, true)], (1, 0, 64), 0),
        (
            "unknown session and turn skipped",
            vec![p("zz", 0, 0.0, true), p("a", 5, 0.0, true), p("a", 0, 1.0, true)],
            (1, 0, 32),
            2,
        ),
    ];
    for (name, sent, (requests, reused, total), unknown) in cases {
        let (c, u) = ceiling_with_history(&sessions, &sent, 16);
        assert_eq!(
            (c.requests, c.tokens_reused, c.tokens_total),
            (requests, reused, total),
            "{name}"
        );
        assert_eq!(u, unknown, "{name}");
    }
    // With nothing in the warm-up and the planned order, it is the schedule's ceiling.
    let all: Vec<SentPrompt<'_>> =
        vec![p("a", 0, 0.0, true), p("b", 0, 0.0, true), p("a", 1, 10.0, true)];
    assert_eq!(ceiling_with_history(&sessions, &all, 16).0, sessions_ceiling(&sessions, 16));
}

#[test]
fn session_spans_and_population_share() {
    // Turns of 4 output tokens at 10 ms each (40 ms) and 10 ms think times.
    let one = tok_session("x", 0.0, vec![1; 4], &[4]);
    let three = tok_session("y", 0.0, vec![1; 4], &[2, 3, 4]);
    assert_eq!(session_span_ms(&one, 10.0), 40.0);
    assert_eq!(session_span_ms(&three, 10.0), 3.0 * 40.0 + 2.0 * 10.0);
    let both = vec![one, three];
    assert_eq!(mean_session_span_ms(&both, 10.0), (40.0 + 140.0) / 2.0);
    assert_eq!(mean_session_span_ms(&[], 10.0), 0.0);
    // Spans 40 and 140: at t = 40 the live population is (40 + 40) / 180 of its steady size.
    let cases =
        [(0.0, 0.0), (40.0, 80.0 / 180.0), (100.0, 140.0 / 180.0), (140.0, 1.0), (1e9, 1.0)];
    for (t, want) in cases {
        assert!((population_share_at(&both, 10.0, t) - want).abs() < 1e-12, "t = {t}");
    }
    assert_eq!(population_share_at(&[], 10.0, 5.0), 1.0);
}

#[test]
fn tool_calls_render_in_openai_shape() {
    let mut call = ChatMsg::new("assistant", "calling".into());
    call.tool_call = Some(("call_1".into(), "search".into(), "{\"q\":1}".into()));
    let mut out = ChatMsg::new("tool", "result".into());
    out.tool_call_id = Some("call_1".into());
    let j = call.to_json();
    assert_eq!(j["tool_calls"][0]["function"]["name"], json!("search"));
    assert_eq!(out.to_json()["tool_call_id"], json!("call_1"));
}

#[test]
fn a_session_of_the_sweeps_model_keeps_its_chain_and_one_naming_a_model_moves_it() {
    let ids: Vec<u32> = (0..32).collect();
    let s = tok_session("s", 0.0, ids.clone(), &[32]);
    // One model (None): the chain starts at seed 0, as before sessions could name a model.
    let bytes: Vec<u8> = ids[..16].iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(segments(&s, 0, 16)[0], (xxh3(&bytes, 0), 16));
    assert_eq!(s.body(0, "m").unwrap()["model"], "m");
    let a = Session { model: Some("a".into()), ..s.clone() };
    let b = Session { model: Some("b".into()), ..s.clone() };
    assert_eq!(a.body(0, "m").unwrap()["model"], "a");
    let (sa, sb, s0) = (segments(&a, 0, 16), segments(&b, 0, 16), segments(&s, 0, 16));
    assert!(sa.iter().all(|x| !sb.contains(x) && !s0.contains(x)));
    assert_eq!(sa.iter().map(|x| x.1).collect::<Vec<_>>(), vec![16, 16]);
    // The same prompt under two models: nothing reused across them.
    let c = sessions_ceiling(&[a, b], 16);
    assert_eq!((c.tokens_reused, c.tokens_total), (0, 64));
}
